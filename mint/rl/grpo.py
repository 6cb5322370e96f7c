"""GRPO math: group advantages, the clipped per-token objective, and loss aggregation as per-sequence weights.

Pure torch, no models, no Ray. The learner runs one backward per group (or per response) on several data-parallel
ranks, so the loss is written as a sum over sequences s and their tokens t:

    L = sum_s w_s * sum_{t in s} loss_t

where the weights w_s come from `token_weights` and depend only on GLOBAL counts (all ranks, all groups of the step)
that are known before any backward. Each response's backward is then independent, and the accumulated gradients equal
the gradient of the global loss exactly. `aggregate` is the same sum for one local list, for tests and simple callers.

Notation: G responses per group, B groups, T tokens of one response, S sequences.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mint.errors import ConfigError

AGG_MODES = ("token-mean", "seq-mean-token-mean", "constant")
# |log r| bound before r = exp(log r) is formed. Off-policy with IcePop off nothing else bounds log r: exp(88.7)
# overflows fp32, and an inf ratio gives a NaN gradient even on a clipped token (exp's backward multiplies the clip's
# 0 by inf), which skips the whole step. 20 (r = 4.9e8) is far past any clip edge (1 +- eps) and the IcePop band, so
# within it nothing changes. Past it r is a constant (zero gradient): for A > 0 the clip already gives 0 there; for
# A < 0 the unclipped gradient -A r would be over 4.9e8 |A| from one token, which the global norm clip would let
# shrink every other token's update to nothing. The same bound as the trust mask's (longstraw.trust.LOG_RATIO_CLAMP).
LOG_RATIO_CLAMP = 20.0


def group_advantages_batch(rewards_B_G: Tensor, scale_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Per-group advantages for B groups of G responses: adv_B_G, float32.

    A_bi = r_bi - mean_j(r_bj), divided by (std_b + eps) when `scale_std`. std_b is the UNBIASED sample std
    (divisor G - 1), as torch.std defaults to and as TRL's GRPOTrainer uses; for [1, 0, 0, 1] it is 1/sqrt(3), so
    the advantages are +-sqrt(3)/2, not the +-1 a population std would give.

    A group whose rewards are all equal gets 0 everywhere (0 / (0 + eps)), and G = 1 gets 0 (there is nothing to
    compare against; the unbiased std of one sample would be NaN).
    """
    if rewards_B_G.dim() != 2:
        raise ValueError(f"rewards_B_G must be 2-D [B, G], got shape {tuple(rewards_B_G.shape)}")
    # fp32 whatever comes in (bool, int, bf16 rewards): bf16 would round 0.5 / 0.577 to 3 significant digits.
    rewards_B_G = rewards_B_G.detach().to(torch.float32)
    B, G = rewards_B_G.shape
    if G < 2:
        return torch.zeros(B, G, dtype=torch.float32, device=rewards_B_G.device)
    adv_B_G = rewards_B_G - rewards_B_G.mean(dim=1, keepdim=True)
    if scale_std:
        std_B_1 = rewards_B_G.std(dim=1, keepdim=True, unbiased=True)
        adv_B_G = adv_B_G / (std_B_1 + eps)
    return adv_B_G


def group_advantages(rewards_G: Tensor, scale_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantages of one group of G responses: adv_G, float32. Same math as `group_advantages_batch` with B = 1."""
    if rewards_G.dim() != 1:
        raise ValueError(f"rewards_G must be 1-D [G], got shape {tuple(rewards_G.shape)}")
    return group_advantages_batch(rewards_G.unsqueeze(0), scale_std=scale_std, eps=eps).squeeze(0)


def zero_variance_mask(rewards_B_G: Tensor, atol: float = 0.0) -> Tensor:
    """keep_B (bool): True where a group's rewards are not all equal, i.e. max_i r_bi - min_i r_bi > atol.

    A group with equal rewards has all-zero advantages, so it adds no policy gradient (only KL, if any) while still
    counting in the token totals; filtering it is the DAPO "dynamic sampling" choice. G = 1 is never kept.
    """
    if rewards_B_G.dim() != 2:
        raise ValueError(f"rewards_B_G must be 2-D [B, G], got shape {tuple(rewards_B_G.shape)}")
    rewards_B_G = rewards_B_G.detach().to(torch.float32)
    spread_B = rewards_B_G.amax(dim=1) - rewards_B_G.amin(dim=1)
    return spread_B > atol


@dataclass(frozen=True)
class LossSpec:
    """How the per-token GRPO objective is clipped, regularised and aggregated."""

    eps_low: float = field(default=0.2, metadata={"help": "lower PPO clip: the ratio is clipped below at 1 - eps_low"})
    eps_high: float = field(
        default=0.28, metadata={"help": "upper PPO clip (DAPO clip-higher): the ratio is clipped above at 1 + eps_high"}
    )
    agg: str = field(
        default="token-mean",
        metadata={
            "help": "loss aggregation: token-mean (DAPO, sum / all tokens), seq-mean-token-mean (GRPO paper), or "
            "constant (Dr.GRPO, sum / (sequences * norm_constant))"
        },
    )
    norm_constant: int = field(
        default=0, metadata={"help": "Dr.GRPO normalizer in tokens, e.g. the max generation length; agg=constant only"}
    )
    kl_coef: float = field(default=0.0, metadata={"help": "weight of the k3 KL(pi || pi_ref) penalty; 0 disables it"})

    def __post_init__(self) -> None:
        if self.agg not in AGG_MODES:
            close = difflib.get_close_matches(str(self.agg), AGG_MODES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"loss.agg: unknown mode {self.agg!r}{hint}; choose one of {', '.join(AGG_MODES)}")
        for name in ("eps_low", "eps_high", "kl_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"loss.{name}: must be a finite number, got {value!r}")
            if value < 0:
                raise ConfigError(f"loss.{name}: must be >= 0, got {value!r}")
        # eps_low >= 1 puts the lower clip at a ratio <= 0, which no ratio exp(.) can go below: clipping is then off.
        if self.eps_low >= 1:
            raise ConfigError(f"loss.eps_low: must be < 1 (the lower clip is 1 - eps_low), got {self.eps_low!r}")
        if isinstance(self.norm_constant, bool) or not isinstance(self.norm_constant, int) or self.norm_constant < 0:
            raise ConfigError(f"loss.norm_constant: must be an int >= 0, got {self.norm_constant!r}")
        if self.agg == "constant" and self.norm_constant <= 0:
            raise ConfigError("loss.norm_constant: agg=constant needs norm_constant > 0 (the max generation length)")


def per_token_objective(
    logp_T: Tensor,
    old_logp_T: Tensor,
    adv_T: Tensor,
    spec: LossSpec,
    ref_logp_T: Tensor | None = None,
    is_weight_T: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token GRPO loss of one response: loss_T (float32) and detached per-token stats.

    logp_T: [T] log-probs of the sampled tokens under the policy being trained (the only input with a gradient).
    old_logp_T: [T] the same under the policy that sampled them. adv_T: [T], or [] broadcast (one per response).
    ref_logp_T: [T] under the reference policy, needed when spec.kl_coef > 0. is_weight_T: [T] importance weights
    of the policy-gradient term (truncated importance sampling, grpo.tis_cap), constants; the KL term is unweighted.

        r_t    = exp(clamp(logp_t - old_logp_t, -20, 20))          (LOG_RATIO_CLAMP: finite, never NaN grads)
        pg_t   = -min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)
        kl_t   = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (k3 estimator of KL(pi || pi_ref), >= 0)
        loss_t = w_t * pg_t + kl_coef * kl_t                        (w_t = is_weight_T, 1 without)

    The clipped branch is active (clipped_T) where the clipped surrogate is strictly smaller: A > 0 and
    r > 1 + eps_high, or A < 0 and r < 1 - eps_low. There d pg / d logp = 0; elsewhere it is -A * r.
    stats: clipped_T (bool), ratio_T, kl_T (zeros without ref_logp_T; computed for logging even when kl_coef = 0).
    """
    if spec.kl_coef > 0 and ref_logp_T is None:
        raise ValueError("per_token_objective: spec.kl_coef > 0 needs ref_logp_T")
    if old_logp_T.shape != logp_T.shape:
        raise ValueError(f"old_logp_T shape {tuple(old_logp_T.shape)} != logp_T shape {tuple(logp_T.shape)}")
    if ref_logp_T is not None and ref_logp_T.shape != logp_T.shape:
        raise ValueError(f"ref_logp_T shape {tuple(ref_logp_T.shape)} != logp_T shape {tuple(logp_T.shape)}")
    # fp32 from here: bf16 values just above 1.0 are 2^-7 = 0.0078 apart, so a bf16 ratio could not tell an
    # on-policy r = 1.003 from 1, and the clip test at 1 + eps_high would flip on rounding.
    logp_T = logp_T.to(torch.float32)
    old_logp_T = old_logp_T.detach().to(torch.float32)
    adv_T = adv_T.detach().to(torch.float32)

    ratio_T = torch.exp((logp_T - old_logp_T).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped_T = ratio_T * adv_T
    clipped_surr_T = ratio_T.clamp(1.0 - spec.eps_low, 1.0 + spec.eps_high) * adv_T
    clipped_T = clipped_surr_T < unclipped_T
    # where() rather than torch.minimum: minimum splits the gradient in half at ties, and we want the clipped
    # tokens to be exactly the ones with zero gradient (the clamped ratio is constant there).
    loss_T = -torch.where(clipped_T, clipped_surr_T, unclipped_T)
    if is_weight_T is not None:
        loss_T = loss_T * is_weight_T.detach().to(torch.float32)

    if ref_logp_T is not None:
        delta_T = ref_logp_T.detach().to(torch.float32) - logp_T
        kl_T = torch.exp(delta_T) - delta_T - 1.0
        if spec.kl_coef > 0:
            loss_T = loss_T + spec.kl_coef * kl_T
        kl_T = kl_T.detach()
    else:
        kl_T = torch.zeros_like(ratio_T.detach())

    stats = {"clipped_T": clipped_T.detach(), "kl_T": kl_T, "ratio_T": ratio_T.detach()}
    return loss_T, stats


def token_weights(lengths_S: Sequence[int] | Tensor, spec: LossSpec, total_tokens: int, total_seqs: int) -> Tensor:
    """Per-sequence weights w_S (float32) so that the step loss is L = sum_s w_s * sum_{t in s} loss_t.

    total_tokens and total_seqs are GLOBAL counts: every sequence of the step on every rank, in every group.
        token-mean            L = sum of all loss_t / total_tokens                   w_s = 1 / total_tokens
        seq-mean-token-mean   L = mean over sequences of (mean of its loss_t)        w_s = 1 / (len_s * total_seqs)
        constant (Dr.GRPO)    L = sum of all loss_t / (total_seqs * norm_constant)   w_s = 1 / (total_seqs * C)
    A zero-length sequence gets w_s = 0; whether it counts in total_seqs is the caller's choice.
    """
    lengths = [int(n) for n in (lengths_S.tolist() if isinstance(lengths_S, Tensor) else lengths_S)]
    if any(n < 0 for n in lengths):
        raise ValueError(f"token_weights: negative length in {lengths}")
    # Local counts can never exceed the global ones: catching this catches local counts passed as global.
    if sum(lengths) > total_tokens or len(lengths) > total_seqs:
        raise ValueError(
            f"token_weights: {len(lengths)} local sequences / {sum(lengths)} tokens exceed the global "
            f"total_seqs={total_seqs} / total_tokens={total_tokens}"
        )
    weights = []
    for n in lengths:
        if n == 0:
            weights.append(0.0)
        elif spec.agg == "token-mean":
            weights.append(1.0 / total_tokens)
        elif spec.agg == "seq-mean-token-mean":
            weights.append(1.0 / (n * total_seqs))
        else:
            weights.append(1.0 / (total_seqs * spec.norm_constant))
    return torch.tensor(weights, dtype=torch.float32)


def aggregate(loss_T_list: Sequence[Tensor], spec: LossSpec) -> Tensor:
    """The step loss L = sum_s w_s * sum_t loss_t of one local list of per-sequence losses, counts taken locally.

    Equals the direct formulas of `token_weights` with total_tokens = all tokens in the list and total_seqs = its
    length. An empty list (or all-empty sequences) gives a 0 scalar.
    """
    if len(loss_T_list) == 0:
        return torch.zeros((), dtype=torch.float32)
    lengths_S = [loss_T.numel() for loss_T in loss_T_list]
    w_S = token_weights(lengths_S, spec, total_tokens=sum(lengths_S), total_seqs=len(lengths_S))
    sums_S = torch.stack([loss_T.to(torch.float32).sum() for loss_T in loss_T_list])
    return (w_S.to(sums_S.device) * sums_S).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * mask) / max(sum(mask), 1) over all elements, in float32; masked-out NaNs do not leak in."""
    mask = mask.to(torch.bool)
    total = torch.where(mask, x.to(torch.float32), torch.zeros((), dtype=torch.float32, device=x.device)).sum()
    return total / mask.sum().clamp_min(1).to(torch.float32)
