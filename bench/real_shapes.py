"""Real per-layer shapes: a few MoE layers of a real base (public config dims, random bf16 weights, no download).

Usage:
    python bench/real_shapes.py                                  # Qwen3-30B-A3B dims, 2 layers, P=1024, G=4, R=64
    python bench/real_shapes.py --prompt-len 4096                # only the naive full-sequence step vs exact (C=256)
    python bench/real_shapes.py --shape glm45_air --layers 1
    python bench/real_shapes.py --shape qwen35_35b_a3b --save    # a hybrid: one Gated DeltaNet + one full layer
    python bench/real_shapes.py --quantization fp8               # factored_ckpt on the bf16 base and its FP8 copy

Each configuration runs in a fresh process (as bench/longstraw_memory.py does; MALLOC_MMAP_THRESHOLD_=65536 on CPU):
  equality      the same model and LoRA (lora_B ~ N(0, 0.02), so the update is not zero) through PEFT's
                materialized expert LoRA and through Mint's factored path: logits and LoRA gradients of one sequence
  materialized  one LongStraw exact update, PEFT materializing W + s*B@A per expert stack per forward
  factored      the same update, expert LoRA as x@A then @B per routed token (mint.models.lora)
  factored_ckpt the same, each layer checkpointed inside replays and prompt-backward chunks (what Mint runs)
  naive         the full-sequence step on the factored model, one sequence at a time (--prompt-len >= 2048 only)
  <config>:tensors  the same run measured by tensor peak instead (longstraw.memory.TensorPeak, the profiler's
                allocation log: what max_memory_allocated reports on a GPU); --prompt-len >= 2048 runs factored_ckpt
                and naive both ways, and naive_over_exact_memory is the tensor-peak ratio (the RSS one: *_rss)
Saved bytes are measured with saved-tensor hooks (longstraw.memory.GraphMeter); peaks with PeakMeter (RSS above a
baseline taken after the model is built). Per-layer figures divide by --layers; `mint plan` multiplies them by the
real layer count (mint/models/measured/<shape>.json is written with --save).

Hybrid shapes (Qwen3.5-MoE, Qwen3-Next) run one configuration, `hybrid`, in its own process: the model is built with
--layers decoder layers (n - 1 Gated DeltaNet, then one gated full-attention layer; transformers' own classes, real
dims, random bf16 weights, LoRA r on q/k/v/o of the full layer and on the fused experts, factored) and a small vocab
(the per-layer figures never touch the embedding or the head). It measures, per layer kind:
  weights       parameter bytes of one decoder layer (base and LoRA)
  boundary      a real captured state: the model runs the P-token prompt with transformers' cache, and the state a
                linear layer hands on (S [H_v, d_k, d_v], the conv window) and a full layer's K/V are read from it;
                the kept boundary is S in fp32 + the last K - 1 pre-conv rows in the model dtype, as real tensors
  replay        bytes saved for backward per token by one decoder layer on R response tokens (saved-tensor hooks,
                weights excluded), plain and checkpointed; the full layer attends over the response tokens only (the
                prefix pages go through LongStraw's prefix attention, whose saved bytes do not grow with P)
  chunk         the same checkpointed over a C-token prompt chunk (exact mode's prompt backward)
  chunk peak    tensor peak (TensorPeak) of one layer's forward + backward over C tokens: the recompute of one
                chunk's layer in the prompt backward, the working buffers `mint plan` adds

MLA shapes (GLM-4.7-Flash, GLM-5, DeepSeek-V3.2, Kimi-K2.5) run one configuration, `mla`: --layers MoE decoder layers
of transformers' own classes (Glm4MoeLite, GlmMoeDsa, DeepseekV32, DeepseekV3) at the real dims, random bf16 weights,
a 512-token vocab, LoRA r on q_a/q_b, kv_a_proj_with_mqa, kv_b_proj, o_proj and the fused experts (factored);
--experts builds fewer routed experts than the real count (top-k and widths unchanged: the per-token figures stay, the
weights shrink; GLM-5's 256 would be 19 GB of bf16 per layer). It measures the figures above for one MLA layer (mla_*)
and, from a real capture (transformers' cache after the P-token prompt, which holds the latent):
  latent        the normed latent [1, 1, P, kv_lora_rank] and the roped key [1, 1, P, qk_rope_head_dim]
  expanded      the module's own expand_kv of them: K [1, heads, P, nope + rope], V [1, heads, P, v]
  indexer       DSA: the indexer keys [1, P, index_head_dim]
  expanded_over_latent_prefix_bytes = expanded K/V bytes per token over latent page bytes per token.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(ROOT, "mint", "models", "measured")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3_30b_a3b", help="qwen3_30b_a3b | qwen3_235b_a22b | glm45_air")
    ap.add_argument("--layers", type=int, default=2, help="MoE layers built")
    ap.add_argument("--prompt-len", type=int, default=1024, help="P")
    ap.add_argument("--group", type=int, default=4, help="G")
    ap.add_argument("--response-len", type=int, default=64, help="R (every response)")
    ap.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="C, capture and prompt-backward chunk (default 1024; 256 for the long-prompt comparison, where the "
        "prompt-backward recompute of one chunk's MoE layer sets exact mode's peak)",
    )
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank")
    ap.add_argument("--experts", type=int, default=0, help="MLA shapes: routed experts built (0: the real count)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default="", help="comma list (default: all that apply)")
    ap.add_argument("--save", action="store_true", help="write mint/models/measured/<shape>.json")
    ap.add_argument(
        "--quantization",
        choices=("none", "fp8"),
        default="none",
        help="fp8: factored_ckpt on the bf16 base and on its FP8 copy (128 x 128 blocks), side by side",
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def build(args, factored: bool, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    from mint.config import LoraConfig
    from mint.models.lora import add_lora
    from mint.models.shapes import layer_config, shape

    torch.manual_seed(0)
    cfg = layer_config(shape(args.shape), args.layers, max_positions=args.prompt_len + args.response_len + 16)
    base = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval().requires_grad_(False)
    if args.quantization == "fp8":
        from mint.models.quant_checkpoint import quantize_model

        base = quantize_model(base, (128, 128))
    model = add_lora(base, LoraConfig(rank=args.rank, alpha=2.0 * args.rank), seed=0, factored_experts=factored)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen).mul_(0.02).to(p.dtype))
    return model


def objective(i, logp_R, ref_R):
    return -((1.0 if i % 2 == 0 else -1.0) * logp_R).mean(), {}


def _inputs(args, vocab):
    gen = torch.Generator().manual_seed(2)
    tokens_P = torch.randint(0, vocab, (args.prompt_len,), generator=gen)
    return tokens_P, [torch.randint(0, vocab, (args.response_len,), generator=gen) for _ in range(args.group)]


def worker_equality(args) -> dict:
    """Logits and LoRA gradients of one 96-token sequence through PEFT's materialized path and the factored one, in
    fp32 (same math, fp32 rounding only) and in bf16, and each bf16 path's error against the fp32 materialized one
    (random init is identical across dtypes: the fp32 weights are the bf16 ones upcast)."""
    from longstraw.scoring import token_logprobs

    def run(factored, dtype):
        model = build(args, factored, torch.bfloat16)
        if dtype == torch.float32:
            model = model.float()  # the very same bf16 weights, upcast
        ids = torch.randint(0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(3))
        logits = model(input_ids=ids).logits[0].float()
        token_logprobs(logits[:-1], ids[0, 1:]).sum().backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    def diff(a, b):
        (la, ga), (lb, gb) = a, b
        rel = max(float((gb[n] - ga[n]).abs().max() / ga[n].abs().max().clamp_min(1e-30)) for n in ga)
        return float((la - lb).abs().max()), rel

    ref = run(False, torch.float32)
    fp32_logits, fp32_grad = diff(ref, run(True, torch.float32))
    mat = run(False, torch.bfloat16)
    fac = run(True, torch.bfloat16)
    bf16_logits, bf16_grad = diff(mat, fac)
    mat_err = diff(ref, mat)
    fac_err = diff(ref, fac)
    return {
        "factored_logits_maxdiff": bf16_logits,
        "factored_grad_maxrel": bf16_grad,
        "factored_logits_maxdiff_fp32": fp32_logits,
        "factored_grad_maxrel_fp32": fp32_grad,
        "bf16_vs_fp32_logits_maxdiff": {"materialized": mat_err[0], "factored": fac_err[0]},
        "bf16_vs_fp32_grad_maxrel": {"materialized": mat_err[1], "factored": fac_err[1]},
        "logits_absmax": float(ref[0].abs().max()),
        "lora_tensors_compared": len(ref[1]),
    }


def worker_update(args, factored: bool, ckpt: bool, tensors: bool) -> dict:
    from longstraw.engine import UpdateSpec, grpo_update
    from longstraw.memory import PeakMeter, TensorPeak

    model = build(args, factored)
    tokens_P, responses = _inputs(args, model.config.vocab_size)
    spec = UpdateSpec(mode="exact", chunk_size=args.chunk, measure_graph=True, checkpoint_min_tokens=1 if ckpt else 0)
    if tensors:
        with TensorPeak() as meter:
            grpo_update(model, tokens_P, responses, objective, spec)
        return {"tensor_peak_bytes": meter.nbytes}
    reset = PeakMeter("cpu")
    reset.start()  # only to learn whether VmHWM resets here (the engine's own meter takes the peak)
    t0 = time.perf_counter()
    metrics = grpo_update(model, tokens_P, responses, objective, spec)  # the measured run
    base = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()] if "lora_" not in n}
    return {
        "base_bytes": sum(t.numel() * t.element_size() for t in base.values()),
        "layer_bytes": sum(t.numel() * t.element_size() for n, t in base.items() if ".layers." in n),
        "peak_bytes": metrics.peak_memory_bytes,
        "replay_saved_bytes": metrics.graph_bytes_max,
        "prompt_chunk_saved_bytes": metrics.prompt_graph_bytes_max,
        "prefix_bytes": metrics.prefix_bytes,
        "dkv_bytes": metrics.dkv_bytes,
        "seconds": round(time.perf_counter() - t0, 1),
        **reset.report(),
    }


def worker_naive(args, tensors: bool) -> dict:
    from longstraw.memory import PeakMeter, TensorPeak
    from longstraw.scoring import token_logprobs

    model = build(args, True)
    tokens_P, responses = _inputs(args, model.config.vocab_size)

    def step():
        for i, r in enumerate(responses):
            logits = model(input_ids=torch.cat([tokens_P, r[:-1]])[None], logits_to_keep=r.shape[0]).logits[0]
            objective(i, token_logprobs(logits, r), None)[0].backward()
            del logits

    if tensors:
        with TensorPeak() as tensor_meter:
            step()
        return {"tensor_peak_bytes": tensor_meter.nbytes}
    meter = PeakMeter("cpu")
    meter.start()
    t0 = time.perf_counter()
    step()
    return {"peak_bytes": meter.peak(), "seconds": round(time.perf_counter() - t0, 1), **meter.report()}


def build_hybrid(args):
    """The hybrid or MLA model with --layers layers of the real dims, a 512-token vocab and factored LoRA (an MLA
    shape's on its recipe targets, `mla_lora_modules`; --experts routed experts when given)."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from mint.config import LoraConfig
    from mint.models.lora import add_lora
    from mint.models.plan import mla_lora_modules
    from mint.models.shapes import layer_config, shape

    torch.manual_seed(0)
    small = dataclasses.replace(shape(args.shape), vocab=512, experts=args.experts or shape(args.shape).experts)
    cfg = layer_config(small, args.layers, max_positions=args.prompt_len + args.response_len + 16)
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval().requires_grad_(False)
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    if small.mla:
        lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, target_modules=list(mla_lora_modules(small)))
    return add_lora(base, lora, seed=0)


def worker_mla(args) -> dict:
    """One MLA MoE layer's figures, and its latent, expanded K/V and indexer pages from a real capture."""
    from longstraw.memory import GraphMeter, TensorPeak, module_storages

    model = build_hybrid(args)
    inner = model.get_base_model().model
    layer, cfg, P = inner.layers[0], inner.config, args.prompt_len
    params = list(layer.named_parameters())
    out: dict = {
        "experts_built": cfg.n_routed_experts,
        "mla_weight_bytes": sum(p.nbytes for n, p in params if "lora_" not in n),
        "mla_lora_params": sum(p.numel() for n, p in params if "lora_" in n),
    }
    tokens_P = torch.randint(0, cfg.vocab_size, (1, P), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(input_ids=tokens_P, use_cache=True).past_key_values
        latent, k_rot = cache.layers[0].keys, cache.layers[0].values  # what the module caches: [1, 1, P, C], [.., R]
        keys, values = layer.self_attn.expand_kv(latent, k_rot)  # [1, heads, P, nope + rope], [1, heads, P, v]
    page = (latent.nbytes + k_rot.nbytes) / P
    out.update(
        latent_shape=list(latent.shape),
        rope_key_shape=list(k_rot.shape),
        latent_dtype=str(latent.dtype),
        expanded_k_shape=list(keys.shape),
        expanded_v_shape=list(values.shape),
        latent_bytes_per_token_layer=page,
        expanded_kv_bytes_per_token_layer=(keys.nbytes + values.nbytes) / P,
        expanded_over_latent_prefix_bytes=(keys.nbytes + values.nbytes) / P / page,
    )
    index_keys = getattr(cache.layers[0], "indexer_keys", None)
    if index_keys is not None:  # DSA: [1, P, index_head_dim], no gradient
        out.update(indexer_key_shape=list(index_keys.shape), indexer_bytes_per_token_layer=index_keys.nbytes / P)
    del cache, latent, k_rot, keys, values, index_keys

    def layer_fn(n, start):
        position_ids = torch.arange(start, start + n)[None]
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]  # the DSA indexer needs an explicit mask

        def f(x):
            pos = inner.rotary_emb(x, position_ids)
            y = layer(x, attention_mask=mask, position_embeddings=pos, position_ids=position_ids)
            return y[0] if isinstance(y, tuple) else y  # a DSA layer also returns its top-k indices

        return f

    out.update(_layer_figures(args, "mla", layer_fn, cfg.hidden_size, module_storages(model), GraphMeter, TensorPeak))
    return out


def _layer_figures(args, kind, layer_fn, hidden, weights, GraphMeter, TensorPeak) -> dict:
    """Saved bytes per token of one layer on R response tokens (plain and checkpointed) and on a C-token prompt chunk
    (checkpointed), and the tensor peak of its forward + backward over the chunk."""
    from torch.utils.checkpoint import checkpoint

    out, gen = {}, torch.Generator().manual_seed(4)
    for name, n in (("replay", args.response_len), ("chunk", min(args.chunk, args.prompt_len))):
        x = torch.randn(1, n, hidden, generator=gen).to(torch.bfloat16).requires_grad_(True)
        f = layer_fn(n, args.prompt_len)
        if name == "replay":
            with GraphMeter(weights) as meter:
                y = f(x)
            out[f"{kind}_replay_saved_bytes_per_token"] = meter.nbytes / n
            del y
        with GraphMeter(weights) as meter:
            y = checkpoint(f, x, use_reentrant=False)
        out[f"{kind}_ckpt_{name}_saved_bytes_per_token"] = meter.nbytes / n
        del y
    x = torch.randn(1, n, hidden, generator=gen).to(torch.bfloat16).requires_grad_(True)
    with TensorPeak() as peak:
        f(x).float().square().mean().backward()
    out[f"{kind}_chunk_layer_peak_bytes"] = peak.nbytes
    return out


def worker_hybrid(args) -> dict:
    """Per-layer figures of a hybrid's two layer kinds, and its boundary state from a real capture."""
    from longstraw.memory import GraphMeter, TensorPeak, module_storages

    model = build_hybrid(args)
    inner = model.get_base_model().model
    cfg = inner.config
    weights = module_storages(model)
    kinds = cfg.layer_types
    out: dict = {"layer_types": kinds}
    for i in (kinds.index("linear_attention"), kinds.index("full_attention")):
        kind = "linear" if kinds[i] == "linear_attention" else "full"
        params = list(inner.layers[i].named_parameters())
        out[f"{kind}_weight_bytes"] = sum(p.nbytes for n, p in params if "lora_" not in n)
        out[f"{kind}_lora_params"] = sum(p.numel() for n, p in params if "lora_" in n)

    # Capture: the prompt through transformers' cache, no graph; read the state each layer kind hands on.
    tokens_P = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(input_ids=tokens_P, use_cache=True).past_key_values
    lin, full = kinds.index("linear_attention"), kinds.index("full_attention")
    state_HKV = cache.layers[lin].recurrent_states[0]  # [1, H_v, d_k, d_v]
    conv_CK = cache.layers[lin].conv_states[0]  # [1, conv_dim, window] pre-conv rows, model dtype
    K = cfg.linear_conv_kernel_dim
    boundary = [state_HKV.float().contiguous(), conv_CK[..., -(K - 1) :].contiguous()]  # what LongStraw keeps
    keys, values = cache.layers[full].keys, cache.layers[full].values  # [1, kv_heads, P, head_dim]
    out.update(
        captured_state_shape=list(state_HKV.shape),
        captured_state_dtype=str(state_HKV.dtype),
        captured_conv_shape=list(conv_CK.shape),
        captured_conv_dtype=str(conv_CK.dtype),
        boundary_state_bytes_per_linear_layer=sum(t.nbytes for t in boundary),
        kv_bytes_per_token_full_layer=(keys.nbytes + values.nbytes) / args.prompt_len,
        kv_shape=list(keys.shape),
    )
    del cache, keys, values

    def run_layer(i, x, position_ids):
        layer = inner.layers[i]
        pos = inner.rotary_emb(x, position_ids)
        return layer(x, position_embeddings=pos, position_ids=position_ids, attention_mask=None)

    for i, kind in ((lin, "linear"), (full, "full")):

        def layer_fn(n, start, i=i):
            position_ids = torch.arange(start, start + n)[None]
            return lambda x: run_layer(i, x, position_ids)

        out.update(_layer_figures(args, kind, layer_fn, cfg.hidden_size, weights, GraphMeter, TensorPeak))
        model.zero_grad(set_to_none=True)
    return out


def worker(args) -> dict:
    torch.set_num_threads(args.threads)
    if args.worker == "hybrid":
        return worker_hybrid(args)
    if args.worker == "mla":
        return worker_mla(args)
    if args.worker == "equality":
        return worker_equality(args)
    name, _, meter = args.worker.partition(":")  # "<config>:tensors" measures the tensor peak (TensorPeak) instead
    if name == "naive":
        return worker_naive(args, tensors=meter == "tensors")
    return worker_update(args, name != "materialized", ckpt=name == "factored_ckpt", tensors=meter == "tensors")


def run_worker(args, config: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", config]
    keys = ("shape", "layers", "prompt_len", "group", "response_len", "chunk", "rank", "threads", "experts")
    for key in (*keys, "quantization"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"worker {config} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{config}: {json.dumps(result)} ({time.time() - t0:.0f} s)", file=sys.stderr)
    return result


def main() -> None:
    args = parse_args()
    if args.chunk is None:
        args.chunk = 256 if args.prompt_len >= 2048 and not args.worker else 1024
    if args.worker:
        print(json.dumps(worker(args)))
        return
    from mint.models.shapes import shape

    if args.quantization == "fp8":
        return fp8_main(args)
    if shape(args.shape).hybrid or shape(args.shape).mla:
        return hybrid_main(args)
    configs = args.configs.split(",") if args.configs else ["equality", "materialized", "factored", "factored_ckpt"]
    if not args.configs and args.prompt_len >= 2048:
        # The long-prompt comparison only, by RSS and by tensor bytes (each in its own process: the profiler's
        # event log would add to RSS).
        configs = ["factored_ckpt", "naive", "factored_ckpt:tensors", "naive:tensors"]
    runs = {c: run_worker(args, c) for c in configs}

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    L, R = args.layers, args.response_len
    summary = {}
    if "materialized" in runs and "factored" in runs:
        summary["materialized_over_factored_saved_bytes"] = ratio(
            runs["materialized"]["replay_saved_bytes"], runs["factored"]["replay_saved_bytes"]
        )
    if "equality" in runs:
        summary.update({k: v for k, v in runs["equality"].items() if k.startswith(("factored_", "bf16_vs"))})
    if "factored" in runs and "factored_ckpt" in runs:
        summary["replay_saved_bytes_ckpt_over_plain"] = ratio(
            runs["factored_ckpt"]["replay_saved_bytes"], runs["factored"]["replay_saved_bytes"]
        )
    if "naive:tensors" in runs:  # the allocator's view: what PeakMeter reads on a GPU (max_memory_allocated)
        summary["naive_over_exact_memory"] = ratio(
            runs["naive:tensors"]["tensor_peak_bytes"], runs["factored_ckpt:tensors"]["tensor_peak_bytes"]
        )
    if "naive" in runs:  # process RSS: also counts heap pages glibc keeps after frees (longstraw.memory.TensorPeak)
        summary["naive_over_exact_memory_rss"] = ratio(runs["naive"]["peak_bytes"], runs["factored_ckpt"]["peak_bytes"])
        summary["naive_over_exact_time"] = ratio(runs["naive"]["seconds"], runs["factored_ckpt"]["seconds"])
    per_layer = {}
    for name in ("materialized", "factored", "factored_ckpt"):
        if name in runs:
            per_layer[f"{name}_replay_saved_bytes_per_token_layer"] = runs[name]["replay_saved_bytes"] / (R * L)
            # A prompt chunk runs every layer but the last in full (the last stops at its K/V): L - 1 full layers.
            per_layer[f"{name}_chunk_saved_bytes_per_token_layer"] = runs[name]["prompt_chunk_saved_bytes"] / (
                min(args.chunk, args.prompt_len - 1) * max(1, L - 1)
            )
    if "factored_ckpt" in runs:  # what the peak holds beyond the kept terms: one chunk's working buffers
        r = runs["factored_ckpt"]
        kept = r["prefix_bytes"] + r["dkv_bytes"] + r["replay_saved_bytes"] + r["prompt_chunk_saved_bytes"]
        per_layer["factored_ckpt_transient_bytes"] = max(0, r["peak_bytes"] - kept)
    summary.update(
        shape=args.shape,
        layers=L,
        P=args.prompt_len,
        G=args.group,
        R=R,
        chunk=args.chunk,
        lora_rank=args.rank,
        dtype="bfloat16",
        device="cpu",
        per_layer=per_layer,
        runs=runs,
    )
    save(args, summary)
    print(json.dumps(summary))


def fp8_main(args) -> None:
    """One exact update (factored_ckpt) on the bf16 base and on its FP8 copy, each in its own process: the decoder
    layers' bytes (and the whole model's), the bytes saved for backward (weights excluded, so a dequantized copy
    kept by the graph would count), the RSS peak and the time."""
    as_run = {q: argparse.Namespace(**{**vars(args), "quantization": q}) for q in ("none", "fp8")}
    runs = {q: run_worker(run_args, "factored_ckpt") for q, run_args in as_run.items()}
    bf16, fp8 = runs["none"], runs["fp8"]
    summary = {
        "bench": "real_shapes_fp8",
        "shape": args.shape,
        "layers": args.layers,
        "P": args.prompt_len,
        "G": args.group,
        "R": args.response_len,
        # The decoder layers, what scales with the model (the embeddings and head stay in the dtype, and the 2 layers
        # built here sit beside a full-size vocabulary: the whole model's ratio reads low for it).
        "bf16_over_fp8_base_bytes": round(bf16["layer_bytes"] / fp8["layer_bytes"], 3),
        "bf16_over_fp8_model_bytes_with_embeddings": round(bf16["base_bytes"] / fp8["base_bytes"], 3),
        "fp8_over_bf16_replay_saved_bytes": round(fp8["replay_saved_bytes"] / bf16["replay_saved_bytes"], 4),
        "fp8_over_bf16_chunk_saved_bytes": round(fp8["prompt_chunk_saved_bytes"] / bf16["prompt_chunk_saved_bytes"], 4),
        "fp8_over_bf16_peak_rss": round(fp8["peak_bytes"] / bf16["peak_bytes"], 3),
        "fp8_over_bf16_seconds": round(fp8["seconds"] / bf16["seconds"], 3),
        "runs": runs,
    }
    print(json.dumps(summary))


def save(args, summary: dict) -> None:
    if args.save:
        os.makedirs(MEASURED, exist_ok=True)
        path = os.path.join(MEASURED, f"{args.shape}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({**summary, "date": time.strftime("%Y-%m-%d"), "machine": "CPU-2"}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def hybrid_main(args) -> None:
    """One `hybrid` (or `mla`) run; per_layer holds what `mint plan` reads, keyed by layer kind."""
    from mint.models.shapes import shape

    config = "mla" if shape(args.shape).mla else "hybrid"
    run = run_worker(args, config)
    keys = [k for k in run if k.endswith(("_per_token", "_peak_bytes", "_weight_bytes", "_lora_params", "_layer"))]
    per_layer = {k: run[k] for k in keys}
    if config == "hybrid":
        per_layer["boundary_state_bytes_per_linear_layer"] = run["boundary_state_bytes_per_linear_layer"]
        per_layer["kv_bytes_per_token_full_layer"] = run["kv_bytes_per_token_full_layer"]
    top = {k: run[k] for k in ("expanded_over_latent_prefix_bytes", "experts_built") if k in run}
    summary = dict(
        **top,
        shape=args.shape,
        layers=args.layers,
        P=args.prompt_len,
        R=args.response_len,
        chunk=args.chunk,
        lora_rank=args.rank,
        dtype="bfloat16",
        device="cpu",
        per_layer=per_layer,
        runs={config: run},
    )
    save(args, summary)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
