"""Each supported router's weight rule, so route replay (R3) can weigh recorded expert ids the way the router would.

A router picks k experts and weighs them; replay swaps in the rollout's ids and must recompute their weights from the
learner's own router logits by the same rule. The rule is a property of the router class, listed in `ROUTER_RULES`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from longstraw.errors import LongStrawError


@dataclass(frozen=True)
class RouterRule:
    """How a router weighs the k experts it picked, from its logits: what replay must recompute for other ids.

    The rule is read off each router's own forward (transformers 5.24), never guessed from attributes: Qwen3.5-MoE's
    router always renormalizes and has no `norm_topk_prob`, and MiniMax-M2's takes its score-correction bias from
    the block, so neither attribute tells its rule.
    """

    sigmoid: bool  # scores = sigmoid(logits) in fp32; else softmax(logits) in fp32
    renormalize: str  # "always", or the router attribute that says whether (norm_topk_prob)
    eps: float = 0.0  # added to the top-k sum before dividing (GLM's 1e-20, kept for bit-equal weights)
    scale: str | None = None  # router attribute the weights are multiplied by (routed_scaling_factor)


_SOFTMAX_BY_FLAG = RouterRule(sigmoid=False, renormalize="norm_topk_prob")
# Every router class route recording and replay accept; any other is refused when the routers are looked up.
ROUTER_RULES: dict[str, RouterRule] = {
    "Qwen2MoeTopKRouter": _SOFTMAX_BY_FLAG,
    "Qwen3MoeTopKRouter": _SOFTMAX_BY_FLAG,
    "Qwen3NextTopKRouter": _SOFTMAX_BY_FLAG,
    "Qwen3_5MoeTopKRouter": RouterRule(sigmoid=False, renormalize="always"),
    # Ranks by sigmoid + e_score_correction_bias within the best groups; weighs by the unbiased sigmoid. The
    # DeepSeek-V3 router and the MLA families built on it (GLM-4.7-Flash, DeepSeek-V3.2, GLM-5) run the same forward.
    **{
        name: RouterRule(sigmoid=True, renormalize="norm_topk_prob", eps=1e-20, scale="routed_scaling_factor")
        for name in (
            "Glm4MoeTopkRouter",
            "DeepseekV3TopkRouter",
            "Glm4MoeLiteTopkRouter",
            "DeepseekV32TopkRouter",
            "GlmMoeDsaTopkRouter",
        )
    },
    # Ranks by sigmoid + the block's bias; weighs by the unbiased sigmoid, always renormalized.
    "MiniMaxM2TopKRouter": RouterRule(sigmoid=True, renormalize="always"),
}


def check_replayable(routers: list[nn.Module]) -> None:
    """Route replay needs each router's weight rule (`ROUTER_RULES`); LongStrawError naming the first router class
    without one. Recording needs none: any router that returns its ids can be recorded."""
    unknown = sorted({type(m).__name__ for m in routers} - ROUTER_RULES.keys())
    if unknown:
        raise LongStrawError(
            f"{unknown[0]}: route replay does not know this router's weight rule (known: {', '.join(ROUTER_RULES)}); "
            "set grpo.r3 = false to train without route replay"
        )


def replay_weights(router: nn.Module, logits_T_E: torch.Tensor, ids_T_K: torch.Tensor) -> torch.Tensor:
    """weights_T_K that `router` gives experts `ids_T_K`, from its logits_T_E, by the rule it uses for its own top-k
    (`ROUTER_RULES`): w = p[ids] with p the softmax or sigmoid of the logits in fp32, then w / (sum(w) + eps) when
    the router renormalizes, then w * its scaling factor. Ranking-only terms (a score-correction bias, group-limited
    top-k) never enter the weights. For the router's own ids this is its own output; for replayed ids it is what it
    would have weighed them with. Returned in the logits' dtype, with autograd to the router.
    """
    name = type(router).__name__
    rule = ROUTER_RULES.get(name)
    if rule is None:
        raise LongStrawError(f"{name}: route replay does not know this router's weight rule")
    probs_T_E = logits_T_E.float().sigmoid() if rule.sigmoid else torch.softmax(logits_T_E.float(), dim=-1)
    weights_T_K = probs_T_E.gather(-1, ids_T_K)
    if rule.renormalize == "always" or getattr(router, rule.renormalize, False):
        weights_T_K = weights_T_K / (weights_T_K.sum(dim=-1, keepdim=True) + rule.eps)
    if rule.scale is not None:
        weights_T_K = weights_T_K * getattr(router, rule.scale)
    return weights_T_K.to(logits_T_E.dtype)
