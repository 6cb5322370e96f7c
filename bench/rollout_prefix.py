"""Shared-prefix decoding vs the naive G-copies prefill, side by side on a tiny random Qwen3-MoE.

shared: `RolloutEngine.generate_group`: prefill the prompt once at batch 1 (P token-forwards), repeat the KV cache
        to G rows, decode G rows together.
naive:  G copies of the prompt through prefill at batch G (G x P token-forwards), then the same batched decode.

Both paths use the engine's own `_prefill` / `_decode` phases and the same seed, so the only difference is the
prefill. Token-forwards are counted with a hook on the input embedding, not inferred. The model is built in the
script from `mint.models.specs.tiny_config` (nothing is downloaded).

    python bench/rollout_prefix.py                      # CPU, P=512, G=8, max_tokens=32
    python bench/rollout_prefix.py --device cuda --prompt-len 4096 --group-size 16

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from mint.models.specs import tiny_config
from mint.rollout.engine import RolloutEngine, SamplingParams


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--prompt-len", type=int, default=512, help="P, prompt tokens")
    parser.add_argument("--group-size", type=int, default=8, help="G, completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=32, help="decode steps (no stop ids: every row runs to it)")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size of the random model")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (tiny_config default: 64)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers, all MoE")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per path; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the dev box has 2 shared cores)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    config = tiny_config(
        "qwen3_moe",
        args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        max_position_embeddings=args.prompt_len + args.max_tokens,
        initializer_range=0.05,
    )
    model = AutoModelForCausalLM.from_config(config).to(args.device).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def naive_group(engine: RolloutEngine, prompt_P: torch.Tensor, group_size: int, params, generator):
    """G copies of the prompt through prefill, then the engine's batched decode: what shared-prefix avoids."""
    with torch.inference_mode(), engine._recording() as recorder:
        input_ids_G_P = prompt_P[None].expand(group_size, -1).to(engine.device)
        cache, logits_G_V, routes_G_P_L_K = engine._prefill(input_ids_G_P, recorder)
        return engine._decode(cache, logits_G_V, routes_G_P_L_K[:, -1], params, generator, recorder)


def shared_group(engine: RolloutEngine, prompt_P: torch.Tensor, group_size: int, params, generator):
    return engine.generate_group(prompt_P.tolist(), group_size, params, generator)


def shared_prefill(engine: RolloutEngine, prompt_P: torch.Tensor, group_size: int, generator):
    """The prefill phase alone on the shared path: batch-1 prefill plus the cache repeat to G rows."""
    with torch.inference_mode(), engine._recording() as recorder:
        cache, _, _ = engine._prefill(prompt_P[None].to(engine.device), recorder)
        cache.batch_repeat_interleave(group_size)
        return cache


def naive_prefill(engine: RolloutEngine, prompt_P: torch.Tensor, group_size: int, generator):
    with torch.inference_mode(), engine._recording() as recorder:
        cache, _, _ = engine._prefill(prompt_P[None].expand(group_size, -1).to(engine.device), recorder)
        return cache


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, args: argparse.Namespace, counts: dict[str, int]) -> tuple[float, dict[str, int], object]:
    """Median wall time of `fn(generator)` over args.repeats runs after one warmup; token-forwards of one run."""
    times = []
    result = None
    for repeat in range(args.repeats + 1):
        generator = torch.Generator(device=args.device).manual_seed(args.seed)
        counts.update(prefill=0, decode=0)
        sync(args.device)
        start = time.perf_counter()
        result = fn(generator)
        sync(args.device)
        if repeat > 0:  # the first run is warmup (allocator, kernel caches)
            times.append(time.perf_counter() - start)
    return statistics.median(times), dict(counts), result


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args)
    engine = RolloutEngine(model, eos_token_ids=[])
    prompt_P = torch.randint(0, args.vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(args.seed))
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    group_size = args.group_size

    counts = {"prefill": 0, "decode": 0}

    def count(module, inputs) -> None:
        batch, seq = inputs[0].shape
        counts["prefill" if seq > 1 else "decode"] += batch * seq

    handle = model.get_input_embeddings().register_forward_pre_hook(count)
    run_shared = lambda gen: shared_group(engine, prompt_P, group_size, params, gen)
    run_naive = lambda gen: naive_group(engine, prompt_P, group_size, params, gen)
    shared_s, shared_counts, shared = timed(run_shared, args, counts)
    naive_s, naive_counts, naive = timed(run_naive, args, counts)
    shared_prefill_s, _, _ = timed(lambda gen: shared_prefill(engine, prompt_P, group_size, gen), args, counts)
    naive_prefill_s, _, _ = timed(lambda gen: naive_prefill(engine, prompt_P, group_size, gen), args, counts)
    handle.remove()

    shared_tokens_G_N = torch.stack([c.tokens_R for c in shared.completions])
    naive_tokens_G_N = naive.tokens_G_N.cpu()
    result = {
        "bench": "rollout_prefix",
        "device": args.device,
        "prompt_len": args.prompt_len,
        "group_size": group_size,
        "max_tokens": args.max_tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "layers": args.layers,
        "threads": args.threads,
        "repeats": args.repeats,
        "shared_s": round(shared_s, 4),
        "naive_s": round(naive_s, 4),
        "naive_over_shared_time": round(naive_s / shared_s, 3),
        "shared_prefill_s": round(shared_prefill_s, 4),
        "naive_prefill_s": round(naive_prefill_s, 4),
        "naive_over_shared_prefill_time": round(naive_prefill_s / shared_prefill_s, 3),
        "shared_prefill_token_forwards": shared_counts["prefill"],
        "naive_prefill_token_forwards": naive_counts["prefill"],
        "shared_decode_token_forwards": shared_counts["decode"],
        "naive_decode_token_forwards": naive_counts["decode"],
        # Same seed, same decode: tokens agree unless batch-G vs batch-1 prefill numerics flip a draw.
        "same_tokens": bool(torch.equal(shared_tokens_G_N, naive_tokens_G_N)),
    }
    print(
        f"shared prefix: {shared_s:.3f} s ({shared_counts['prefill']} prefill token-forwards)   "
        f"naive: {naive_s:.3f} s ({naive_counts['prefill']})   naive/shared: {naive_s / shared_s:.2f}x   "
        f"(prefill phase alone: {shared_prefill_s:.3f} s vs {naive_prefill_s:.3f} s)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
