"""Rollout throughput: the built-in engine (all groups of a step in one decode batch) against batched HF `generate`.

Both sides sample the same model (a LoRA-wrapped MoE built here, nothing downloaded), the same prompts of varied
lengths, the same number of sequences (prompts x G) and tokens (every row runs to max_tokens: no eos, no stop ids),
at temperature 1 with top-p 1 (HF's default top_k=50 is switched off so both draw from the full distribution):

    builtin            RolloutEngine.generate(prompts, G, ...): each distinct prompt prefilled once, one KV slab,
                       one [B, 1] forward per step; it also records per-token logprobs and routes (R3)
    builtin_per_group  the same engine called once per prompt (one group of G rows per decode, as the engine once did)
    hf_generate        model.generate on the prompts x G rows, left-padded, one batch (HF's DynamicCache, G copies
                       of every prompt through prefill); it records neither logprobs nor routes

Rows: expert LoRA on (`lora.target_experts`, factored: mint.models.expert_lora), and off (LoRA on attention only).
`--shape qwen3_30b_a3b --layers 1` runs the same comparison on real-shape layers (mint/models/shapes.py, random
weights; slow on CPU, so use a small --prompts/--group/--max-tokens there).

    python bench/rollout_throughput.py                                   # tiny Qwen3-MoE, 8 prompts x G=8, 32 tokens
    python bench/rollout_throughput.py --device cuda --prompts 32 --max-tokens 256
    python bench/rollout_throughput.py --shape qwen3_30b_a3b --layers 1 --prompts 2 --group 4 --max-tokens 8

Tokens/s counts generated tokens (prompts x G x max_tokens) over the wall time of the whole call, prefill included
(median of --repeats timed runs after one warmup, the paths interleaved run by run). The last stdout line is one JSON
object; its `builtin_over_hf_generate_tokens_per_s` is the ratio with expert LoRA on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from mint.config import LoraConfig
from mint.models.lora import add_lora
from mint.models.specs import tiny_config
from mint.rollout.engine import RolloutEngine, SamplingParams


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--shape", default="", help="a real shape from mint/models/shapes.py; empty: the tiny base")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (all MoE)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary of the tiny base (real shapes: theirs)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    parser.add_argument("--prompts", type=int, default=8, help="groups per step")
    parser.add_argument("--group", type=int, default=8, help="G, completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=64, help="longest prompt; prompts span [len/2, len]")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per completion (every row runs to it)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the dev box has 2 shared cores)")
    parser.add_argument("--skip-per-group", action="store_true", help="leave out the builtin_per_group path")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def base_config(args: argparse.Namespace):
    max_positions = args.prompt_len + args.max_tokens + 8
    if args.shape:
        from mint.models.shapes import layer_config, shape

        return layer_config(shape(args.shape), args.layers, max_positions=max_positions)
    return tiny_config(
        "qwen3_moe",
        args.vocab,
        num_hidden_layers=args.layers,
        max_position_embeddings=max_positions,
        initializer_range=0.05,
    )


def build(args: argparse.Namespace, target_experts: bool) -> torch.nn.Module:
    """The base with LoRA (rank --rank, attention projections, plus the experts when `target_experts`); lora_B is
    drawn non-zero so the adapter changes what is sampled."""
    torch.manual_seed(args.seed)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    base = AutoModelForCausalLM.from_config(base_config(args), dtype=dtype).eval()
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, target_experts=target_experts)
    model = add_lora(base, lora, args.seed).to(args.device).eval()
    generator = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.requires_grad_(False)
            if "lora_B" in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator).to(param.dtype))
    return model


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(args.seed)
    shortest = max(1, args.prompt_len // 2)
    lengths = torch.randint(shortest, args.prompt_len + 1, (args.prompts,), generator=gen).tolist()
    lengths[0] = args.prompt_len  # the longest prompt sets the padded width on both sides
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def run_builtin(engine: RolloutEngine, prompts, args, params) -> int:
    groups = engine.generate(prompts, args.group, params, seed=args.seed)
    return sum(len(c.tokens_R) for g in groups for c in g.completions)


def run_builtin_per_group(engine: RolloutEngine, prompts, args, params) -> int:
    tokens = 0
    for index, prompt in enumerate(prompts):
        group = engine.generate([prompt], args.group, params, seed=args.seed + index)[0]
        tokens += sum(len(c.tokens_R) for c in group.completions)
    return tokens


def hf_inputs(prompts, args) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts x G rows, left-padded with id 0 (masked): what a caller of `generate` would batch."""
    width = max(len(p) for p in prompts)
    ids_B_P = torch.zeros(len(prompts) * args.group, width, dtype=torch.int64)
    mask_B_P = torch.zeros_like(ids_B_P)
    for index, prompt in enumerate(prompts):
        rows = slice(index * args.group, (index + 1) * args.group)
        ids_B_P[rows, width - len(prompt) :] = torch.tensor(prompt)
        mask_B_P[rows, width - len(prompt) :] = 1
    return ids_B_P.to(args.device), mask_B_P.to(args.device)


def run_hf_generate(model, inputs, args) -> int:
    ids_B_P, mask_B_P = inputs
    torch.manual_seed(args.seed)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids_B_P,
            attention_mask=mask_B_P,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=args.max_tokens,
            min_new_tokens=args.max_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return (out.shape[1] - ids_B_P.shape[1]) * out.shape[0]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def compare(args: argparse.Namespace, target_experts: bool) -> dict:
    """Median tokens/s of each path on one model, the paths interleaved run by run."""
    model = build(args, target_experts)
    vocab = model.config.vocab_size
    prompts = make_prompts(args, vocab)
    engine = RolloutEngine(model, eos_token_ids=[])
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens)
    inputs = hf_inputs(prompts, args)
    paths = {
        "builtin": lambda: run_builtin(engine, prompts, args, params),
        "hf_generate": lambda: run_hf_generate(model, inputs, args),
    }
    if not args.skip_per_group:
        paths["builtin_per_group"] = lambda: run_builtin_per_group(engine, prompts, args, params)
    times: dict[str, list[float]] = {name: [] for name in paths}
    tokens: dict[str, int] = {}
    for repeat in range(args.repeats + 1):
        for name, fn in paths.items():
            sync(args.device)
            start = time.perf_counter()
            tokens[name] = fn()
            sync(args.device)
            if repeat > 0:  # the first round is warmup (allocator, kernel caches)
                times[name].append(time.perf_counter() - start)
    expected = len(prompts) * args.group * args.max_tokens
    if any(n != expected for n in tokens.values()):
        raise RuntimeError(f"paths generated different token counts: {tokens}, expected {expected}")
    row = {"target_experts": target_experts, "sequences": len(prompts) * args.group, "tokens": expected}
    for name, samples in times.items():
        seconds = statistics.median(samples)
        row[f"{name}_s"] = round(seconds, 4)
        row[f"{name}_tokens_per_s"] = round(expected / seconds, 1)
    row["builtin_over_hf_generate_tokens_per_s"] = round(row["hf_generate_s"] / row["builtin_s"], 3)
    if "builtin_per_group_s" in row:
        row["builtin_over_per_group_tokens_per_s"] = round(row["builtin_per_group_s"] / row["builtin_s"], 3)
    return row


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    rows = [compare(args, target_experts=True), compare(args, target_experts=False)]
    for row in rows:
        label = "expert LoRA on " if row["target_experts"] else "expert LoRA off"
        per_group = f"  per-group {row['builtin_per_group_tokens_per_s']:8.1f}" if "builtin_per_group_s" in row else ""
        print(
            f"{label}: builtin {row['builtin_tokens_per_s']:8.1f} tok/s  hf_generate "
            f"{row['hf_generate_tokens_per_s']:8.1f} tok/s{per_group}  "
            f"builtin/hf {row['builtin_over_hf_generate_tokens_per_s']:.2f}x"
        )
    on, off = rows
    result = {
        "bench": "rollout_throughput",
        "device": args.device,
        "shape": args.shape or "tiny:qwen3_moe",
        "layers": args.layers,
        "dtype": args.dtype,
        "prompts": args.prompts,
        "group": args.group,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "rank": args.rank,
        "threads": args.threads,
        "repeats": args.repeats,
        "expert_lora_on": on,
        "expert_lora_off": off,
        "builtin_over_hf_generate_tokens_per_s_expert_lora_off": off["builtin_over_hf_generate_tokens_per_s"],
        "builtin_over_hf_generate_tokens_per_s": on["builtin_over_hf_generate_tokens_per_s"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
