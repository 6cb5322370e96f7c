"""Rollout/learner mismatch on a tiny MoE, without and with R3 route replay, side by side in one run.

Setup: a random tiny Qwen3-MoE built here (no downloads) with init std 0.08, so that routing matters: with
transformers' default 0.02 the random experts are so weak that a changed route barely moves a logprob (a probe saw
2.5% of tokens change route while the KL moved only from 3.8e-6 to 3.1e-6). The rollout engine samples in bfloat16
(`--rollout bf16`, the default) or in fp32 with Gaussian noise added to the router logits (`--rollout noise`) to
mimic a different inference engine; the learner scores the same prompts and sampled responses in fp32.

Measured per response token (the positions that produce tokens, where R3 applies):
    out_of_route_no_r3            share whose fp32 learner-native top-k set differs from the rollout's
    out_of_route_with_r3_replayed share whose experts actually run by the learner (seen by a hook on the experts)
                                  differ from the recorded ones, on mappable tokens: must be 0
    kl_no_r3, kl_with_r3          mismatch KL, k3 estimate of KL(pi_rollout || pi_learner) on the rollout's samples
    icepop_masked_fraction        share outside the IcePop band [0.5, 5] with R3 on
    route_bytes_per_token         bytes of the [L, k] route record per token (uint8 ids)

Run: python bench/r3_mismatch.py [--rollout bf16|noise] [--prompts 32] [--group 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from longstraw.routing import RouteReplay, find_routers, route_status
from longstraw.scoring import token_logprobs
from longstraw.trust import icepop_status
from mint.models.specs import moe_layout, tiny_config
from mint.rollout.engine import RolloutEngine, SamplingParams


def build(path: str, init_std: float, seed: int) -> None:
    torch.manual_seed(seed)
    config = tiny_config("qwen3_moe", 512, num_hidden_layers=4, num_experts=8, initializer_range=init_std)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def add_router_noise(model, sigma: float, seed: int) -> None:
    """Perturb each router's logits with fixed Gaussian noise per call: another engine's numerics, in miniature."""
    gen = torch.Generator().manual_seed(seed)

    def hook(module, args, output):
        logits, _, _ = output
        noisy = logits + sigma * torch.randn(logits.shape, generator=gen)
        probs = torch.softmax(noisy.float(), -1)
        top, ids = probs.topk(module.top_k, -1)
        if module.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return noisy, top.to(logits.dtype), ids

    for router in find_routers(model):
        router.register_forward_hook(hook)


def experts_used(model, store: list):
    """Forward-pre hooks that record the expert ids each MoE block actually runs."""
    blocks = [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    return [b.experts.register_forward_pre_hook(lambda mod, args: store.append(args[1].detach())) for b in blocks]


def score(model, prompt_P, response_R, temperature, routes=None):
    """fp32 logprobs of one response, native routing or replaying `routes` [P+R-1, L, k]; plus used/native ids."""
    ids = torch.cat([prompt_P, response_R[:-1]])[None]
    used: list[torch.Tensor] = []
    handles = experts_used(model, used)
    try:
        with torch.no_grad():
            if routes is None:
                logits = model(ids, logits_to_keep=len(response_R)).logits[0]
                native = None
            else:
                with RouteReplay(model) as replay:
                    replay.set(routes, torch.ones(len(routes), dtype=torch.bool))
                    logits = model(ids, logits_to_keep=len(response_R)).logits[0]
                    native = replay.native()
    finally:
        for h in handles:
            h.remove()
    return token_logprobs(logits, response_R, temperature), torch.stack(used, 1), native


def k3(learner_logp, rollout_logp):
    d = (learner_logp - rollout_logp).clamp(-20, 20)
    return torch.exp(d) - d - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollout", choices=("bf16", "noise"), default="bf16")
    ap.add_argument("--noise", type=float, default=0.05, help="router-logit noise std for --rollout noise")
    ap.add_argument("--init-std", type=float, default=0.08)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    start = time.time()

    path = tempfile.mkdtemp(prefix="r3bench-")
    build(path, args.init_std, args.seed)
    learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if args.rollout == "bf16":
        rollout = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    else:
        rollout = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        add_router_noise(rollout, args.noise, args.seed)
    layout = moe_layout(learner.config)

    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 512, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    groups = RolloutEngine(rollout, eos_token_ids=[]).generate(prompts, args.group, params, seed=args.seed)

    tokens = oor_native = oor_replayed = mappable = masked = 0
    kl_no = kl_with = 0.0
    for group in groups:
        prompt_P = group.prompt_tokens_P
        for c in group.completions:
            rollout_logp = c.logprobs_R.float()
            routes = torch.cat([group.prompt_routes_P1_L_K, c.routes_R_L_K])  # [P+R-1, L, k]
            logp_no, used_no, _ = score(learner, prompt_P, c.tokens_R, 1.0)
            logp_r3, used_r3, _ = score(learner, prompt_P, c.tokens_R, 1.0, routes=routes)
            resp = slice(len(prompt_P) - 1, None)  # the positions that produced response tokens
            recorded = routes[resp].long().sort(-1).values
            oor_native += int((used_no[resp].sort(-1).values != recorded).flatten(1).any(1).sum())
            ok = route_status(routes, len(routes), layout)[resp] == 0
            diff_r3 = (used_r3[resp].sort(-1).values != recorded).flatten(1).any(1)
            oor_replayed += int(diff_r3[ok].sum())
            mappable += int(ok.sum())
            tokens += len(c.tokens_R)
            kl_no += float(k3(logp_no, rollout_logp).sum())
            kl_with += float(k3(logp_r3, rollout_logp).sum())
            masked += int((icepop_status(logp_r3, rollout_logp, 0.5, 5.0) > 0).sum())

    result = {
        "bench": "r3_mismatch",
        "rollout": args.rollout if args.rollout == "bf16" else f"fp32+router_noise_{args.noise}",
        "learner": "fp32",
        "init_std": args.init_std,
        "layers": layout.num_layers,
        "experts": layout.num_experts,
        "top_k": layout.top_k,
        "tokens": tokens,
        "out_of_route_no_r3": round(oor_native / tokens, 6),
        "out_of_route_with_r3_replayed": oor_replayed / max(mappable, 1),
        "kl_no_r3": kl_no / tokens,
        "kl_with_r3": kl_with / tokens,
        "kl_ratio": round(kl_with / kl_no, 4) if kl_no > 0 else None,
        "icepop_masked_fraction": masked / tokens,
        "route_bytes_per_token": layout.num_layers * layout.top_k * layout.route_dtype.itemsize,
        "seconds": round(time.time() - start, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
