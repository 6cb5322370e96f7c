"""Rollout/learner mismatch with an FP8 base, three pairings side by side in one run.

The shipped tiny Qwen3-MoE (pretrained on the smoke task) and its FP8 copy (FP8 e4m3, block scales, the DeepSeek-V3
layout; `quantize_checkpoint`) are loaded as the learner and the built-in rollout engine load them, both computing in
`--dtype` (bfloat16 by default). The rollout engine samples G responses per prompt and records its logprobs; the
learner scores the same tokens with R3 replaying the rollout's routes, as a training step does. Pairings:

    plain/plain       learner and rollout on the unquantized base (the engines' own numerics only)
    fp8/fp8           both on the FP8 base: what Mint runs with model.quantization = fp8
    plain/fp8         the learner on the unquantized base, the rollout on FP8: what frameworks that keep a bf16
                      learner and quantize only the rollout engine run

Per pairing, over every response token: mismatch KL (k3 estimate of KL(pi_rollout || pi_learner)), mean absolute
logprob gap, and IcePop's masked fraction in the default band [0.5, 5]. The last line's
`quantized_over_mixed_logprob_gap` is fp8/fp8's gap over plain/fp8's: how much of the mismatch computing on the
engine's own weights removes.

Run: python bench/quant_mismatch.py [--prompts 16] [--group 8] [--dtype bfloat16] [--block 16]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from longstraw.routing import RouteReplay
from longstraw.scoring import token_logprobs
from longstraw.trust import icepop_status
from mint.models.quant_checkpoint import quantize_checkpoint
from mint.models.specs import load_model
from mint.models.tiny import ensure_tiny
from mint.rollout.engine import RolloutEngine, SamplingParams


def learner_logprobs(model, prompt_P, response_R, routes) -> torch.Tensor:
    ids = torch.cat([prompt_P, response_R[:-1]])[None]
    with torch.no_grad(), RouteReplay(model) as replay:
        replay.set(routes, torch.ones(len(routes), dtype=torch.bool))
        logits = model(ids, logits_to_keep=len(response_R)).logits[0]
    return token_logprobs(logits.float(), response_R, 1.0)


def measure(learner, rollout, prompts, group: int, max_tokens: int, seed: int) -> dict:
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    groups = RolloutEngine(rollout, eos_token_ids=[]).generate(prompts, group, params, seed=seed)
    tokens, kl, gap, masked = 0, 0.0, 0.0, 0
    for g in groups:
        for c in g.completions:
            routes = torch.cat([g.prompt_routes_P1_L_K, c.routes_R_L_K])
            learner_logp = learner_logprobs(learner, g.prompt_tokens_P, c.tokens_R, routes)
            rollout_logp = c.logprobs_R.float()
            d = (learner_logp - rollout_logp).clamp(-20, 20)
            kl += float((torch.exp(d) - d - 1).sum())
            gap += float(d.abs().sum())
            masked += int((icepop_status(learner_logp, rollout_logp, 0.5, 5.0) > 0).sum())
            tokens += len(c.tokens_R)
    return {"tokens": tokens, "mismatch_kl": kl / tokens, "logprob_gap": gap / tokens, "icepop_masked": masked / tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--block", type=int, default=16, help="FP8 block size (the tiny base's dims are 16-64)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    start = time.time()

    plain_path = ensure_tiny(args.family)
    fp8_path = quantize_checkpoint(plain_path, tempfile.mkdtemp(prefix="fp8bench-") + "/base", (args.block,) * 2)
    plain, fp8 = load_model(plain_path, args.dtype), load_model(fp8_path, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = plain.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    run = dict(prompts=prompts, group=args.group, max_tokens=args.max_tokens, seed=args.seed)
    pairings = {
        "plain/plain": measure(plain, plain, **run),
        "fp8/fp8": measure(fp8, fp8, **run),
        "plain/fp8": measure(plain, fp8, **run),
    }
    for name, figures in pairings.items():
        print(json.dumps({"pairing": name, "learner/rollout": name, **figures}))
    mixed = pairings["plain/fp8"]["logprob_gap"]
    result = {
        "bench": "quant_mismatch",
        "family": args.family,
        "dtype": args.dtype,
        "fp8_block": args.block,
        **{f"{k}_{name.replace('/', '_')}": v for name, f in pairings.items() for k, v in f.items() if k != "tokens"},
        "tokens_per_pairing": pairings["fp8/fp8"]["tokens"],
        "quantized_over_mixed_logprob_gap": round(pairings["fp8/fp8"]["logprob_gap"] / mixed, 4) if mixed else None,
        "seconds": round(time.time() - start, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
