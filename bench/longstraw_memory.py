"""LongStraw memory benchmark: measured peak memory and time of one GRPO update, naive vs detached vs exact.

Usage (the defaults are the full sizes; on a 2-core CPU pass smaller ones):
    python bench/longstraw_memory.py                                   # P=16384, G=8, R=256, CPU
    python bench/longstraw_memory.py --prompt-len 4096 --response-len 128
    python bench/longstraw_memory.py --device cuda --dtype bfloat16     # on a GPU machine
    python bench/longstraw_memory.py --smoke                           # smoke-size learner steps, side by side
    python bench/longstraw_memory.py --model tiny:qwen3_5_moe --prompt-len 4096   # a hybrid base's state kinds

--smoke times the learner step of recipes/smoke.toml (what `make run` trains) under both inner steps in one process:
two world-size-1 learner ranks set up as a Ray rank is (DeepSpeed ZeRO-1 on gloo, the recipe's LoRA, one torch
thread), one with learner.inner_step = naive and one with longstraw, each running `LearnerActor.step` (inner steps,
reduction, optimizer step) on the same plans, in alternating order. A plan is one rank's share of a smoke step:
prompts_per_step / num_ranks groups of real chat-templated prompts from the recipe's data, G responses of 2 ..
max_tokens random tokens, on-policy rollout logprobs and recorded routes (R3), as the rollout hands them over. The
JSON line gives both medians and `longstraw_over_naive_step_time` (target <= 1.5). Extra `section.key=value`
arguments after --smoke override the recipe (e.g. longstraw.replay_budget_mb=0 for serial replay).

Each configuration runs in a fresh Python process (`--worker`), so allocator caches of one cannot leak into another.
In each, the model, LoRA and AdamW are built and one small warm-up update plus optimizer step is run (optimizer
state allocated, allocator warm); then the baseline is taken and one update over the real inputs is measured:
  peak   : CPU VmHWM (reset through /proc/self/clear_refs) minus VmRSS at the baseline; CUDA max_memory_allocated
           minus memory_allocated at the baseline. Measured, never estimated.
  bound  : M_prefix + M_grad + max_i (M_graph(R_i) + M_score(R_i)) with
           M_prefix  bytes of the captured state (K/V pages; a hybrid model's recurrent boundary beside its full
                     layers' pages, and in exact mode the boundary's chunk-start checkpoints),
           M_grad    bytes of the LoRA gradients,
           M_graph   bytes saved for backward in one replay: saved-tensor hooks over unique storages, excluding
                     weights and the prefix state (longstraw.memory.GraphMeter),
           M_score   the scoring transient: two fp32 [rows, V] blocks (logits and their softmax), rows =
                     min(R, LOGIT_BLOCK_ELEMENTS // V); the engine never keeps [R, V] logits (its CPU path is
                     mint_kernels' fused_logprob_reference, which works in such blocks).
           Exact mode adds its fp32 dKV buffer, and the prompt backward's chunk graph (metered the same way)
           competes with the replay term: bound = M_prefix + M_dkv + M_grad + max(replay term, M_graph(chunk)).
  naive  : the standard full-sequence step at its most frugal: one prompt+response sequence at a time, gradient
           accumulation, logits only for the response positions (logits_to_keep), the model's default attention.
Like for like: `naive_over_exact_memory` (and `_time`) is the headline, because exact mode accumulates the same
gradient as the naive step (full backprop through prompt and response). Detached mode holds the prompt's K/V
constant, a different (response-only) gradient, so `naive_over_detached_memory` is printed beside it as the cost of
that approximation, not as a like-for-like saving.
Every worker reports `peak_meter_reset`: whether PeakMeter's reset of VmHWM worked (see longstraw.memory). Where it
did not, that worker's peak is the process-lifetime peak above the baseline, and the summary says so in `peak_note`.
On CPU the workers run with MALLOC_MMAP_THRESHOLD_=65536 (glibc): large tensors are then always mmapped and given back
to the OS when freed, so RSS follows live tensors instead of glibc's raised dynamic threshold keeping freed tensors
in the heap. Pass --no-malloc-tune to measure with glibc defaults.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--prompt-len", type=int, default=16384, help="P")
    ap.add_argument("--group", type=int, default=8, help="G")
    ap.add_argument("--response-len", type=int, default=256, help="R (every response)")
    ap.add_argument("--chunk", type=int, default=1024, help="C: capture / prompt-backward chunk")
    ap.add_argument(
        "--model",
        default="qwen3_moe",
        help="qwen3_moe: a Qwen3-MoE of the dims below; tiny:<family>: the embedded tiny base's architecture (its "
        "config at --vocab, random weights; the dims below are then unused), e.g. tiny:qwen3_5_moe",
    )
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker")
    ap.add_argument("--configs", default="naive,detached,exact", help="comma list of naive, detached, exact")
    ap.add_argument("--flat-groups", default="2,16", help="G pair for g_flatness (detached); empty to skip")
    ap.add_argument("--no-malloc-tune", action="store_true", help="CPU: keep glibc's dynamic mmap threshold")
    ap.add_argument("--replay-budget-mb", type=float, default=64.0, help="LongStraw's replay micro-batch budget")
    ap.add_argument("--smoke", nargs="*", default=None, metavar="KEY=VALUE", help="smoke-size learner steps")
    ap.add_argument("--smoke-steps", type=int, default=40, help="--smoke: timed steps (after 3 untimed)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# -- worker: one configuration in this process -----------------------------------------------------------------


def model_config(args):
    from transformers import Qwen3MoeConfig

    from mint.models.specs import TINY_PREFIX, tiny_config

    positions = args.prompt_len + args.response_len + 16
    if args.model.startswith(TINY_PREFIX):
        return tiny_config(args.model[len(TINY_PREFIX) :], args.vocab, max_position_embeddings=max(positions, 256))
    if args.model != "qwen3_moe":
        raise SystemExit(f"--model: {args.model!r} is not qwen3_moe or tiny:<family>")
    return Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
    )


def build(args):
    from transformers import AutoModelForCausalLM

    from mint.config import LoraConfig
    from mint.models.lora import add_lora

    torch.manual_seed(0)
    config = model_config(args)
    with torch.device(args.device):
        base = AutoModelForCausalLM.from_config(config, dtype=DTYPES[args.dtype]).eval()
    for p in base.parameters():
        p.requires_grad_(False)
    model = add_lora(base, LoraConfig(), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01)
    lora = [p for p in model.parameters() if p.requires_grad]
    return model, lora, torch.optim.AdamW(lora, lr=1e-5)


def objective(i, logp_R, ref_logp_R):
    adv = 1.0 if i % 2 == 0 else -1.0
    return -(adv * logp_R).mean(), {}


def naive_step(model, tokens_P, responses, meter_graph: bool) -> int:
    """Full-sequence forward+backward per response; logits for response positions only. Returns saved bytes."""
    from longstraw.memory import GraphMeter, module_storages
    from longstraw.scoring import token_logprobs

    graph_bytes = 0
    for i, r in enumerate(responses):
        inputs = torch.cat([tokens_P, r[:-1]])[None]  # position P-1+j predicts r_j; r_{R-1} is never an input
        meter = GraphMeter(module_storages(model)) if meter_graph and i == 0 else None
        with meter if meter is not None else torch.enable_grad():
            logits = model(input_ids=inputs, logits_to_keep=r.shape[0]).logits[0]
            loss, _ = objective(i, token_logprobs(logits, r), None)
        if meter is not None:
            graph_bytes = meter.nbytes
        loss.backward()
        del logits, loss
    return graph_bytes


def state_sizes(args) -> dict:
    """The captured prefix state of prompts of P and 4P positions, by part (K/V pages; a hybrid model's recurrent
    boundary), as the detached and resident modes keep it, and exact mode's chunk-start checkpoints beside it."""
    from longstraw.adapters import LayeredState, adapter_for

    torch.set_num_threads(args.threads)
    model, _, _ = build(args)
    adapter = adapter_for(model)
    out = {}
    for scale in (1, 4):
        tokens_S = torch.randint(0, args.vocab, (scale * args.prompt_len - 1,)).to(args.device)
        state = adapter.capture(tokens_S, args.chunk)
        parts = state.nbytes_by_kind() if isinstance(state, LayeredState) else {"full_attention": state.nbytes}
        kept = adapter.with_options(keep_checkpoints=True).capture(tokens_S, args.chunk)
        out[f"{scale}P"] = {"parts": parts, "with_checkpoints": kept.nbytes}
        del state, kept
    return out


def worker(args) -> dict:
    # LOGIT_BLOCK_ELEMENTS: the block size of the CPU scoring path (fused_logprob_reference); M_score is sized by it.
    from longstraw.engine import UpdateSpec, grpo_update
    from longstraw.memory import PeakMeter
    from mint_kernels._fused_logprob_reference import LOGIT_BLOCK_ELEMENTS

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, lora, optim = build(args)
    gen = torch.Generator().manual_seed(1)

    def inputs(p, g, r):
        tokens_P = torch.randint(0, args.vocab, (p,), generator=gen).to(device)
        return tokens_P, [torch.randint(0, args.vocab, (r,), generator=gen).to(device) for _ in range(g)]

    def step(tokens_P, responses, measure):
        if args.worker == "naive":
            return naive_step(model, tokens_P, responses, measure), None
        budget = int(args.replay_budget_mb * 2**20)
        spec = UpdateSpec(mode=args.worker, chunk_size=args.chunk, measure_graph=measure, replay_budget_bytes=budget)
        return None, grpo_update(model, tokens_P, responses, objective, spec)

    step(*inputs(16, 2, 4), measure=False)  # warm-up: allocates AdamW state and warms the allocator
    optim.step()
    optim.zero_grad(set_to_none=True)

    tokens_P, responses = inputs(args.prompt_len, args.group, args.response_len)
    gc.collect()
    meter = PeakMeter(device)
    meter.start()
    t0 = time.perf_counter()
    naive_graph, metrics = step(tokens_P, responses, measure=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = meter.peak()

    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in lora if p.grad is not None)
    # M_score: the scoring transient, two fp32 [rows, V] blocks (logits and their exp / softmax); naive keeps the
    # whole [R, V] logits instead, which its measured graph already contains.
    score_rows = min(args.response_len, max(1, LOGIT_BLOCK_ELEMENTS // args.vocab))
    score_bytes = 2 * score_rows * args.vocab * 4
    out = {"config": args.worker, "peak_bytes": peak, "seconds": seconds, "grad_bytes": grad_bytes, **meter.report()}
    out["score_bytes"] = score_bytes
    if metrics is None:
        out["graph_bytes"] = naive_graph
        return out
    # The replay term is the largest micro-batch's metered graph (the budget caps its estimate) plus the scoring
    # transient of its rows.
    replay_term = metrics.graph_bytes_max + score_bytes
    bound = metrics.prefix_bytes + metrics.dkv_bytes + grad_bytes + max(replay_term, metrics.prompt_graph_bytes_max)
    out.update(
        bound_bytes=bound,
        prefix_bytes=metrics.prefix_bytes,
        dkv_bytes=metrics.dkv_bytes,
        graph_bytes=metrics.graph_bytes_max,
        prompt_graph_bytes=metrics.prompt_graph_bytes_max,
        capture_s=metrics.capture_s,
        replay_s=metrics.replay_s,
        prompt_backward_s=metrics.prompt_backward_s,
        engine_peak_bytes=metrics.peak_memory_bytes,
        micro_batches=metrics.micro_batches,
    )
    return out


# -- driver: every configuration in a fresh process --------------------------------------------------------------


def run_worker(args, config: str, group: int) -> dict:
    argv = list(sys.argv[1:])
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", config, "--group", str(group)]
    env = dict(os.environ)
    if args.device == "cpu" and not args.no_malloc_tune:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        return {"config": config, "group": group, "error": f"exit {proc.returncode}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["group"] = group
    return result


def mib(n) -> str:
    return f"{n / 2**20:9.1f} MiB"


# -- smoke: both inner steps at the smoke recipe's sizes ----------------------------------------------------------


def _smoke_plans(learner, config, steps: int, seed: int = 0) -> list:
    """One rank's share of `steps` smoke steps (see the module doc), built once and replayed by both learners."""
    from transformers import AutoTokenizer

    from longstraw.routing import RouteRecorder
    from mint.rl.data import load_dataset
    from mint.rollout.prompts import prompt_tokens
    from mint.train.inner_step import GroupBatch, MicroStep, StepPlan, _score_padded

    tokenizer = AutoTokenizer.from_pretrained(learner.model_path)
    model, rollout = learner.engine.module, config.rollout
    groups_per_rank = rollout.prompts_per_step // config.learner.num_ranks
    examples = load_dataset(config.data.source).take(steps * groups_per_rank, seed)
    gen = torch.Generator().manual_seed(seed)
    plans = []
    for s in range(steps):
        groups = []
        for example in examples[s * groups_per_rank : (s + 1) * groups_per_rank]:
            prompt = torch.tensor(prompt_tokens(tokenizer, example))
            lengths = torch.randint(2, rollout.max_tokens + 1, (rollout.group_size,), generator=gen).tolist()
            responses = [torch.randint(len(tokenizer), (n,), generator=gen) for n in lengths]
            routes = []
            with RouteRecorder(model) as recorder, torch.no_grad():
                for r in responses:
                    model(input_ids=torch.cat([prompt, r[:-1]])[None])
                    routes.append(recorder.pop().to(torch.uint8))
            adv = torch.randn(len(responses), generator=gen)
            group = GroupBatch(prompt, responses, [torch.zeros(n) for n in lengths], (adv - adv.mean()) / adv.std(),
                               routes[0][: len(prompt) - 1], [r[len(prompt) - 1 :] for r in routes])  # fmt: skip
            own, _ = _score_padded(learner.ctx, group, with_grad=False, routes=learner.ctx.group_routes(group))
            groups.append(dataclasses.replace(group, rollout_logprobs=[lp.detach() for lp in own]))
        tokens = sum(sum(g.lengths) for g in groups) * config.learner.num_ranks
        seqs = len(groups) * rollout.group_size * config.learner.num_ranks
        plans.append(StepPlan([MicroStep(g, True) for g in groups], tokens, seqs, step=s + 1))
    return plans


def smoke(args) -> dict:
    import socket
    import statistics

    from mint.config import load_config
    from mint.models.tiny import resolve_model_path
    from mint.train.learner import LearnerActor

    recipe = os.path.join(ROOT, "recipes", "smoke.toml")
    learners = {}
    for name in ("naive", "longstraw"):
        config = load_config(recipe, [*args.smoke, "learner.num_ranks=1", f"learner.inner_step={name}"])
        learners[name] = LearnerActor(config, resolve_model_path(config.model.path), 0, 1)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        learners[name].setup("127.0.0.1", port)
    # The plans as the recipe's own ranks see them (its num_ranks, not the bench's one rank).
    plans = _smoke_plans(learners["naive"], load_config(recipe, args.smoke), 3 + args.smoke_steps)
    seconds = {name: [] for name in learners}
    for s, plan in enumerate(plans):
        for name in list(learners)[:: 1 if s % 2 else -1]:  # alternate who goes first
            t0 = time.perf_counter()
            learners[name].step(plan)
            if s >= 3:
                seconds[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(v) for name, v in seconds.items()}
    ls = learners["longstraw"].config.longstraw
    for name, v in seconds.items():
        low, high = min(v) * 1e3, max(v) * 1e3
        print(f"{name:10s} learner step median {median[name] * 1e3:7.1f} ms  (min {low:.1f}, max {high:.1f})")
    return {
        "mode": "smoke",
        "longstraw_over_naive_step_time": round(median["longstraw"] / median["naive"], 3),
        "naive_step_s_median": round(median["naive"], 4),
        "longstraw_step_s_median": round(median["longstraw"], 4),
        "longstraw_mode": ls.mode,
        "replay_budget_mb": ls.replay_budget_mb,
        "steps": args.smoke_steps,
        "groups_per_step": len(plans[0].micro_steps),
        "overrides": args.smoke,
    }


def part_ratio(states: dict, kind: str) -> float | None:
    """bytes of one part of the state at 4P over those at P; None where the model has no such part."""
    if "error" in states or kind not in states["1P"]["parts"]:
        return None
    return round(states["4P"]["parts"][kind] / states["1P"]["parts"][kind], 3)


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(state_sizes(args) if args.worker == "state" else worker(args)))
        return
    if args.smoke is not None:
        print(json.dumps(smoke(args)))
        return
    runs = {c: run_worker(args, c, args.group) for c in args.configs.split(",") if c}
    states = run_worker(args, "state", args.group)
    flat = [int(g) for g in args.flat_groups.split(",") if g]
    flat_runs = [run_worker(args, "detached", g) for g in flat]

    for name, r in [*runs.items(), *((f"detached G={r['group']}", r) for r in flat_runs)]:
        if "error" in r:
            print(f"{name:16s} {r['error']}")
            continue
        bound = ""
        if "bound_bytes" in r:
            bound = f" bound {mib(r['bound_bytes'])} peak/bound {r['peak_bytes'] / r['bound_bytes']:.2f}"
        print(f"{name:16s} peak {mib(r['peak_bytes'])}  graph {mib(r['graph_bytes'])}  {r['seconds']:7.1f} s{bound}")

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    def field(config, key):
        r = runs.get(config) or {}
        return r.get(key)

    all_runs = [*runs.values(), *flat_runs]
    reset = [r.get("peak_meter_reset") for r in all_runs if "error" not in r]
    not_reset = [f"{r['config']} G={r['group']}" for r in all_runs if r.get("peak_meter_reset") is False]
    exact_mem = ratio(field("naive", "peak_bytes"), field("exact", "peak_bytes"))
    detached_mem = ratio(field("naive", "peak_bytes"), field("detached", "peak_bytes"))
    print(f"naive/exact memory {exact_mem} (same gradient)   naive/detached memory {detached_mem} (response-only)")
    summary = {
        # The like-for-like figure first: exact mode's gradient is the naive step's; detached's is response-only.
        "naive_over_exact_memory": exact_mem,
        "naive_over_detached_memory": detached_mem,
        "peak_meter_reset": all(x is True for x in reset) if reset else None,
        "peak_note": (
            "peak is the process-lifetime peak (the peak reset did not work) for: " + ", ".join(not_reset)
            if not_reset
            else "peak covers the measured update only (the peak reset worked in every worker)"
        ),
        "device": args.device,
        "dtype": args.dtype,
        "P": args.prompt_len,
        "G": args.group,
        "R": args.response_len,
        "chunk": args.chunk,
        "replay_budget_mb": args.replay_budget_mb,
        "model": {"name": args.model, "vocab": args.vocab}
        | (
            {}
            if args.model.startswith("tiny:")
            else {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "experts")}
            | {"top_k": args.top_k}
        ),
        "malloc_mmap_threshold": None if args.no_malloc_tune or args.device != "cpu" else 65536,
        "peak_over_bound_detached": ratio(field("detached", "peak_bytes"), field("detached", "bound_bytes")),
        "peak_over_bound_exact": ratio(field("exact", "peak_bytes"), field("exact", "bound_bytes")),
        "naive_over_exact_time": ratio(field("naive", "seconds"), field("exact", "seconds")),
        "naive_over_detached_time": ratio(field("naive", "seconds"), field("detached", "seconds")),
        "g_flatness": ratio(*(r.get("peak_bytes") for r in reversed(flat_runs))) if len(flat_runs) == 2 else None,
        # The captured state at P and 4P by part: K/V pages grow with P; a recurrent boundary must not.
        "state_bytes": {k: v for k, v in states.items() if k != "group"},
        "boundary_bytes_4x_over_1x_P": part_ratio(states, "linear_attention"),
        "pages_bytes_4x_over_1x_P": part_ratio(states, "full_attention"),
        "runs": all_runs,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
