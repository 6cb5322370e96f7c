"""Sharded LongStraw: one exact-mode update per rank at 1, 2 and 4 gloo ranks, expert parallel and context parallel.

Usage:
    python bench/sharded.py                     # a random Qwen3-MoE of 2 layers x 16 experts (H 128), P=257, G=4
    python bench/sharded.py --experts 8 --prompt-len 129

Expert parallel (EP = 1, 2, 4): each rank loads only its experts (`load_expert_parallel`), runs its own group (as a
data-parallel rank does: the groups differ in prompt length and G) through `grpo_update` with the lockstep adapter
(`longstraw.expert_parallel.LockstepAdapter`), and reports its resident routed-expert bytes (base stacks and LoRA,
by storage), its prefix K/V bytes, its measured peak above the start of the update (RSS on CPU), and every byte
its all-to-alls send off the rank (forward and backward, recomputes included) per token that entered an MoE layer.
The LoRA gradients, replicated ones summed over ranks and expert ones gathered from their owners, are compared with
one unsharded process running every rank's group.

Context parallel (CP = 1, 2, 4): every rank runs the same group with the prefix pages split (`cp_adapter_for`), and
reports its prefix K/V bytes and the payload of its CP collectives (capture, replays, prompt backward) per
token of the prompt and responses; each rank's LoRA gradient is
compared with the unsharded one. CP is measured through `cp_adapter_for`, the adapter the learner's
context-parallel step runs (`longstraw.context_parallel`, docs/sharding.md); the learner is not in this benchmark.

The last line printed is one JSON object: expert_bytes_per_rank_ep2_over_ep1, prefix_bytes_per_rank_cp2_over_cp1,
grad_maxdiff_sharded (the largest |gradient - unsharded gradient| over every sharded run), and the rows behind them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longstraw.adapters import adapter_for
from longstraw.context_parallel import collective_log, cp_adapter_for
from longstraw.engine import UpdateSpec, grpo_update
from longstraw.expert_parallel import Lockstep, LockstepAdapter, counted_sends, pad_responses
from mint.config import LoraConfig
from mint.models.expert_parallel import (
    expert_bytes,
    experts_by_layer,
    gather_expert_lora,
    load_expert_parallel,
    load_full_lora_state,
)
from mint.models.lora import add_lora, load_lora_state, lora_state
from mint.models.specs import load_model, tiny_config


def build_model(directory: str, args) -> tuple[str, dict]:
    """A random Qwen3-MoE saved with save_pretrained, and a trained-looking adapter (non-zero B) for it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    overrides = dict(
        hidden_size=args.hidden,
        num_experts=args.experts,
        moe_intermediate_size=args.hidden,
        max_position_embeddings=4 * args.prompt_len,
        initializer_range=0.05,
    )
    AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", 97, **overrides)).save_pretrained(directory)
    state = lora_state(add_lora(load_model(directory), LoraConfig(), seed=0))
    gen = torch.Generator().manual_seed(3)
    return directory, {k: torch.randn(v.shape, generator=gen) * 0.05 if "lora_B" in k else v for k, v in state.items()}


def group(i: int, args) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Rank i's group: prompt lengths and G differ by rank, as data-parallel ranks' groups do."""
    gen = torch.Generator().manual_seed(10 + i)
    prompt = torch.randint(3, 97, (args.prompt_len - 16 * i,), generator=gen)
    lengths = [args.response_len - 2 * j for j in range(args.group_size - (i % 2))]
    return prompt, [torch.randint(3, 97, (n,), generator=gen) for n in lengths]


def spec(args) -> UpdateSpec:
    return UpdateSpec(mode="exact", chunk_size=args.chunk, checkpoint_min_tokens=args.checkpoint_min_tokens)


def objective(i, logp_R, ref_R):
    return -((1.0 if i % 2 else -1.0) * logp_R).mean(), {}


def take_grads(model) -> dict[str, torch.Tensor]:
    grads = {n.replace(".default", ""): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return grads


# ---- workers (one process per rank) ----------------------------------------------------------------------------------


def reference_worker(rank, world, path, state, args):
    """Unsharded: each group's LoRA gradients on its own, and the full capture's prefix bytes."""
    model = add_lora(load_model(path), LoraConfig(), seed=0)
    load_lora_state(model, state)
    out = []
    for i in range(4):
        prompt, responses = group(i, args)
        metrics = grpo_update(model, prompt, responses, objective, spec(args))
        out.append({"grads": take_grads(model), "prefix_bytes": metrics.prefix_bytes})
    return {"groups": out, "expert_bytes": expert_bytes(model)}


def ep_worker(rank, world, path, state, args):
    model, read = load_expert_parallel(path, None, LoraConfig(), seed=0)
    load_full_lora_state(model, state)
    lockstep = Lockstep(None, experts_by_layer(model), model.config.num_experts_per_tok)
    moe_tokens = {"n": 0}
    for _, module in lockstep.experts:
        module.register_forward_pre_hook(lambda m, args_: moe_tokens.__setitem__("n", moe_tokens["n"] + len(args_[0])))
    prompt, responses = group(rank, args)
    extra = pad_responses(lockstep, responses)
    responses = responses + [responses[0][:1]] * extra
    real = len(responses) - extra

    def padded_objective(i, logp_R, ref_R):
        return objective(i, logp_R, ref_R) if i < real else (logp_R.sum() * 0.0, {})

    with counted_sends(rank, world) as sent:
        adapter = LockstepAdapter(adapter_for(model), lockstep)
        metrics = grpo_update(model, prompt, responses, padded_objective, spec(args), adapter=adapter)
    for name, p in model.named_parameters():  # replicated LoRA: each rank's own group, summed as DP would
        if p.grad is not None and "mlp.experts" not in name:
            dist.all_reduce(p.grad)
    grads = gather_expert_lora(model, None, grads=True)
    return {
        "expert_bytes": expert_bytes(model),
        "expert_bytes_read": read["experts"],
        "prefix_bytes": metrics.prefix_bytes,
        "peak_bytes": metrics.peak_memory_bytes,
        "a2a_bytes": sent["bytes"],
        "moe_tokens": moe_tokens["n"],
        "grads": grads,
    }


def cp_worker(rank, world, path, state, args):
    model = add_lora(load_model(path), LoraConfig(), seed=0)
    load_lora_state(model, state)
    prompt, responses = group(0, args)
    with collective_log() as calls:
        metrics = grpo_update(model, prompt, responses, objective, spec(args), adapter=cp_adapter_for(model))
    return {
        "prefix_bytes": metrics.prefix_bytes,
        "dkv_bytes": metrics.dkv_bytes,
        "peak_bytes": metrics.peak_memory_bytes,
        "collective_bytes": sum(b for _, b in calls),
        "replay_tokens": sum(len(r) for r in responses),
        "prompt_tokens": len(prompt) - 1,
        "grads": take_grads(model),
    }


# ---- ranks -----------------------------------------------------------------------------------------------------------


def run_ranks(world: int, fn, *args) -> list:
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as run_dir:
        procs = [ctx.Process(target=_rank_main, args=(run_dir, r, world, fn, args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = [Path(run_dir, f"error_{r}.txt") for r in range(world)]
        failed = [e.read_text() for e in errors if e.exists()]
        if failed or any(p.exitcode for p in procs):
            raise SystemExit("\n".join(failed) or f"rank exit codes {[p.exitcode for p in procs]}")
        return [torch.load(Path(run_dir, f"result_{r}.pt"), weights_only=False) for r in range(world)]


def _rank_main(run_dir, rank, world, fn, args) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{run_dir}/store", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=300),
        )  # fmt: skip
        torch.save(fn(rank, world, *args), f"{run_dir}/result_{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        Path(run_dir, f"error_{rank}.txt").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        code = 1
    os._exit(code)


def maxdiff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:3]
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=257)
    parser.add_argument("--response-len", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--checkpoint-min-tokens", type=int, default=8)
    parser.add_argument("--ranks", default="1,2,4")
    args = parser.parse_args()
    worlds = [int(w) for w in args.ranks.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        path, state = build_model(tmp, args)
        (ref,) = run_ranks(1, reference_worker, path, state, args)
        rows = []
        for world in worlds:
            ep = run_ranks(world, ep_worker, path, state, args)
            want = {k: sum(ref["groups"][i]["grads"][k] for i in range(world)) for k in ref["groups"][0]["grads"]}
            rows.append(
                {
                    "kind": "ep",
                    "ranks": world,
                    "expert_bytes_per_rank": max(r["expert_bytes"]["base"] + r["expert_bytes"]["lora"] for r in ep),
                    "expert_bytes_read_per_rank": max(r["expert_bytes_read"] for r in ep),
                    "prefix_bytes_per_rank": max(r["prefix_bytes"] for r in ep),
                    "peak_bytes_per_rank": max(r["peak_bytes"] for r in ep),
                    "a2a_bytes_per_moe_token": sum(r["a2a_bytes"] for r in ep) / sum(r["moe_tokens"] for r in ep),
                    "grad_maxdiff": maxdiff(ep[0]["grads"], want),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        for world in worlds:
            cp = run_ranks(world, cp_worker, path, state, args)
            rows.append(
                {
                    "kind": "cp",
                    "ranks": world,
                    "prefix_bytes_per_rank": max(r["prefix_bytes"] for r in cp),
                    "dkv_bytes_per_rank": max(r["dkv_bytes"] for r in cp),
                    "peak_bytes_per_rank": max(r["peak_bytes"] for r in cp),
                    # every CP payload of the update (capture, replays, prompt backward) per token it covered
                    "collective_bytes_per_token": cp[0]["collective_bytes"]
                    / (cp[0]["replay_tokens"] + cp[0]["prompt_tokens"]),
                    "grad_maxdiff": max(maxdiff(r["grads"], ref["groups"][0]["grads"]) for r in cp),
                }
            )
            print(json.dumps(rows[-1]), flush=True)

    def row(kind, world):
        return next(r for r in rows if r["kind"] == kind and r["ranks"] == world)

    def ratio(kind, key):
        return row(kind, 2)[key] / row(kind, 1)[key]

    sharded = [r["grad_maxdiff"] for r in rows if r["ranks"] > 1]
    summary = {
        "model": f"qwen3_moe random, 2 layers x {args.experts} experts, H {args.hidden}, fp32",
        "prompt_len": args.prompt_len,
        "group_size": args.group_size,
        "mode": "exact",
        "expert_bytes_per_rank_ep2_over_ep1": ratio("ep", "expert_bytes_per_rank"),
        "prefix_bytes_per_rank_cp2_over_cp1": ratio("cp", "prefix_bytes_per_rank"),
        "cp_path": "cp_adapter_for, the adapter the learner's context-parallel step runs",
        "grad_maxdiff_sharded": max(sharded),
        "rows": rows,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
