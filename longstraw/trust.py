"""The per-token trust mask: route available (R3) AND train/rollout ratio inside [alpha, beta] (IcePop).

A token with weight 0 contributes nothing to the policy-gradient term; it still counts in the loss normalizer (as
in IcePop, where the mask multiplies the token's term and the 1/|y| stays), so masking never inflates the other
tokens' weights. Every masked token is counted under exactly one reason, so the counters add up to the total.

Reasons, in the order they are checked (a token gets the first that applies):

    route_missing       no route record for the token (or the record's length does not match the response)
    route_layers        the record has a different number of MoE layers than the learner
    route_layout        the ids cannot be mapped to the learner's experts: different top-k, or a record made for a
                        different expert count, or a non-integer payload
    route_out_of_range  an id outside [0, num_experts)
    route_duplicate     the same expert twice in one token's top-k at some layer
    non_finite          the rollout's or the learner's log-prob of the token is NaN or +-inf, or so is their
                        difference (IcePop off too)
    ratio_low           r = pi_learner_old / pi_rollout < alpha
    ratio_high          r > beta

Route statuses come from `longstraw.routing.route_status`; the ratio statuses from `icepop_status` here; non_finite is
decided in `trust_mask`. Every comparison with NaN is false, so before non_finite had its own reason a NaN rollout
log-prob sat "inside" the IcePop band and, off-policy, made the loss NaN and the step was skipped. An engine that
reports -inf for a token it sampled (probability 0) is broken the same way, so -inf is non_finite too, not ratio_high.

r is computed in log space and clamped (|log r| <= 20), so a finite but extreme pair gives no inf; r exactly equal to
alpha or beta is inside the band.

`CAUSES` groups the reasons into the causes a step reports as fractions of its response tokens
(`trust_dropped_<cause>`) and the trainer's stop rule names: each cause has one fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw.routing import ROUTE_REASONS

RATIO_REASONS = ("ratio_low", "ratio_high")
NON_FINITE = "non_finite"
REASONS = (*ROUTE_REASONS, NON_FINITE, *RATIO_REASONS)
LOG_RATIO_CLAMP = 20.0
# cause -> the reasons it covers. route_missing alone: an engine that returns no routes at all (started without
# --enable-return-routed-experts) is the common case and has its own fix; the other route reasons mean routes that
# came back but belong to another model.
CAUSES: dict[str, tuple[str, ...]] = {
    "route_missing": ("route_missing",),
    "route_mismatch": tuple(r for r in ROUTE_REASONS if r != "route_missing"),
    NON_FINITE: (NON_FINITE,),
    "icepop": RATIO_REASONS,
}


def icepop_status(old_logp_T: torch.Tensor, rollout_logp_T: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """0 inside the band, 1 below alpha (ratio_low), 2 above beta (ratio_high). int64 [T]."""
    log_r = (old_logp_T.detach().float() - rollout_logp_T.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    status = torch.zeros_like(log_r, dtype=torch.long)
    # Compare in log space: r == alpha exactly stays in band (log of the bounds, not exp of log_r).
    status[log_r < torch.log(torch.tensor(alpha, dtype=torch.float64)).float()] = 1
    status[log_r > torch.log(torch.tensor(beta, dtype=torch.float64)).float()] = 2
    return status


@dataclass
class TrustCounts:
    """Counters over a step; `add` merges another's (ranks, groups). Every masked token has one reason."""

    tokens: int = 0
    kept: int = 0
    masked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    out_of_route: int = 0  # mappable tokens whose learner-native top-k set differs from the rollout's
    routed: int = 0  # mappable tokens that were compared
    mismatch_kl_sum: float = 0.0  # k3(pi_rollout || pi_learner) summed over kept tokens
    indexer_replayed: int = 0  # DSA indexer replay: response query x indexer layer pairs replayed
    indexer_mismatched: int = 0  # of those, pairs whose learner-native selection differed from the rollout's

    def add(self, other: TrustCounts) -> None:
        self.tokens += other.tokens
        self.kept += other.kept
        for k, v in other.masked.items():
            self.masked[k] += v
        self.out_of_route += other.out_of_route
        self.routed += other.routed
        self.mismatch_kl_sum += other.mismatch_kl_sum
        self.indexer_replayed += other.indexer_replayed
        self.indexer_mismatched += other.indexer_mismatched

    def metrics(self) -> dict[str, float]:
        out = {
            "trust_kept_frac": self.kept / max(self.tokens, 1),
            # nan (null in metrics.jsonl) when nothing was compared: no routes, or a dense model.
            "out_of_route_ratio": self.out_of_route / self.routed if self.routed else float("nan"),
            "mismatch_kl": self.mismatch_kl_sum / max(self.kept, 1),
        }
        if self.indexer_replayed:  # only with DSA indexer replay on
            out["mismatch_indexer_ratio"] = self.indexer_mismatched / self.indexer_replayed
        out.update({f"masked_{k}": float(v) for k, v in self.masked.items()})
        out.update({f"trust_dropped_{cause}": frac for cause, frac in self.dropped().items()})
        return out

    def dropped(self) -> dict[str, float]:
        """cause -> the fraction of response tokens masked for it (`CAUSES`); all 0 when there were no tokens."""
        total = max(self.tokens, 1)
        return {cause: sum(self.masked[r] for r in reasons) / total for cause, reasons in CAUSES.items()}


def trust_mask(
    route_status_T: torch.Tensor,
    ratio_status_T: torch.Tensor | None,
    old_logp_T: torch.Tensor,
    rollout_logp_T: torch.Tensor,
) -> tuple[torch.Tensor, TrustCounts]:
    """Weight 1 where the route is mappable, both log-probs are finite and the ratio is in band; 0 elsewhere.
    Returns (mask_T float, counts).

    route_status_T from `route_status` (zeros when R3 is off); ratio_status_T from `icepop_status` (None when IcePop
    is off). The non_finite test runs whether or not IcePop does: a NaN must never reach the loss. mismatch KL on
    kept tokens is the k3 estimate of KL(pi_rollout || pi_learner) from the rollout's samples: with
    d = log pi_learner - log pi_rollout, k3 = exp(d) - d - 1 >= 0.
    """
    counts = TrustCounts(tokens=int(route_status_T.numel()))
    old_T, rollout_T = old_logp_T.detach().float(), rollout_logp_T.float().to(old_logp_T.device)
    finite_T = torch.isfinite(old_T) & torch.isfinite(rollout_T) & torch.isfinite(old_T - rollout_T)
    reason_T = route_status_T.clone()
    non_finite_code = REASONS.index(NON_FINITE) + 1
    reason_T = torch.where((reason_T == 0) & ~finite_T.to(reason_T.device), non_finite_code, reason_T)
    if ratio_status_T is not None:
        # icepop_status's 1 (low) and 2 (high) -> the codes of ratio_low and ratio_high
        ratio_code_T = ratio_status_T.to(reason_T.device) + REASONS.index(RATIO_REASONS[0])
        reason_T = torch.where((reason_T == 0) & (ratio_status_T.to(reason_T.device) > 0), ratio_code_T, reason_T)
    keep_T = reason_T == 0
    for i, reason in enumerate(REASONS):
        counts.masked[reason] = int((reason_T == i + 1).sum())
    counts.kept = int(keep_T.sum())
    d_T = (old_T - rollout_T).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    counts.mismatch_kl_sum = float((torch.exp(d_T) - d_T - 1.0)[keep_T.to(d_T.device)].sum())
    return keep_T.float(), counts


def out_of_route(
    native_N_L_K: torch.Tensor, routes_N_L_K: torch.Tensor, route_status_N: torch.Tensor
) -> tuple[int, int]:
    """(tokens whose native top-k set differs from the recorded one at any layer, mappable tokens compared)."""
    ok_N = route_status_N == 0
    if not bool(ok_N.any()):
        return 0, 0
    native = native_N_L_K[ok_N].long().sort(-1).values
    recorded = routes_N_L_K[ok_N].long().to(native.device).sort(-1).values
    differs = (native != recorded).flatten(1).any(1)
    return int(differs.sum()), int(ok_N.sum())
