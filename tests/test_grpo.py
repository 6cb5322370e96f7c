"""GRPO math against hand-computed values. Every expected number is written out with its arithmetic in a comment."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

from mint.errors import ConfigError
from mint.rl.grpo import (
    LossSpec,
    aggregate,
    group_advantages,
    group_advantages_batch,
    masked_mean,
    per_token_objective,
    token_weights,
    zero_variance_mask,
)

# ---------------------------------------------------------------------------------------------------- advantages


def test_advantages_unscaled():
    # mean(1, 0, 0, 1) = 0.5 -> A = r - 0.5
    adv_G = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), scale_std=False)
    assert adv_G.dtype == torch.float32
    torch.testing.assert_close(adv_G, torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_advantages_scaled_uses_unbiased_std():
    # squared deviations sum to 4 * 0.25 = 1; unbiased var = 1 / (4 - 1) = 1/3; std = 0.5773503
    # A = +-0.5 / (0.5773503 + 1e-6) = +-0.8660239 (sqrt(3)/2 = 0.8660254 without eps; population std would give 1)
    adv_G = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    torch.testing.assert_close(adv_G, torch.tensor([0.8660239, -0.8660239, -0.8660239, 0.8660239]), atol=1e-6, rtol=0)


def test_advantages_all_equal_group_is_zero_not_nan():
    for scale_std in (True, False):
        adv_G = group_advantages(torch.tensor([0.7, 0.7, 0.7]), scale_std=scale_std)
        assert torch.isfinite(adv_G).all()
        torch.testing.assert_close(adv_G, torch.zeros(3))


def test_advantages_single_response_is_zero():
    for scale_std in (True, False):
        adv_G = group_advantages(torch.tensor([3.0]), scale_std=scale_std)
        torch.testing.assert_close(adv_G, torch.zeros(1))


def test_advantages_accept_int_and_bool_rewards():
    # bool rewards [T, F] -> [1, 0]: mean 0.5, unbiased std = sqrt(0.5 / 1) = 0.7071068, A = +-0.5 / 0.7071078
    adv_G = group_advantages(torch.tensor([True, False]))
    torch.testing.assert_close(adv_G, torch.tensor([0.7071058, -0.7071058]), atol=1e-6, rtol=0)


def test_advantages_batch_equals_per_row():
    rewards_B_G = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 3.0, 0.5]])
    for scale_std in (True, False):
        adv_B_G = group_advantages_batch(rewards_B_G, scale_std=scale_std)
        for b in range(3):
            torch.testing.assert_close(adv_B_G[b], group_advantages(rewards_B_G[b], scale_std=scale_std))
    # row 0 by hand, as above; row 2 unscaled: mean(0, 1, 3, 0.5) = 4.5 / 4 = 1.125
    torch.testing.assert_close(
        group_advantages_batch(rewards_B_G)[0], torch.tensor([0.8660239, -0.8660239, -0.8660239, 0.8660239])
    )
    torch.testing.assert_close(
        group_advantages_batch(rewards_B_G, scale_std=False)[2], torch.tensor([-1.125, -0.125, 1.875, -0.625])
    )


def test_advantages_reject_wrong_rank():
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="2-D"):
        group_advantages_batch(torch.zeros(4))


def test_zero_variance_mask():
    rewards_B_G = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.5, 0.5, 0.5, 0.5001]])
    assert zero_variance_mask(rewards_B_G).tolist() == [True, False, True]
    # spread of row 2 is 1e-4 (to fp32 rounding), under atol 1e-3
    assert zero_variance_mask(rewards_B_G, atol=1e-3).tolist() == [True, False, False]
    assert zero_variance_mask(torch.tensor([[1.0]])).tolist() == [False]


# ---------------------------------------------------------------------------------------------- clipped objective

# eps_low = 0.2, eps_high = 0.28: the ratio is clipped to [0.8, 1.28].
SPEC = LossSpec(eps_low=0.2, eps_high=0.28)


def _objective(ratios, adv, spec=SPEC):
    """Loss and grads at old_logp = 0, logp = log(r), for a scalar advantage."""
    logp_T = torch.tensor([math.log(r) for r in ratios], requires_grad=True)
    old_logp_T = torch.zeros(len(ratios), requires_grad=True)
    loss_T, stats = per_token_objective(logp_T, old_logp_T, torch.tensor(adv), spec)
    loss_T.sum().backward()
    assert old_logp_T.grad is None  # gradients flow to logp only
    return loss_T.detach(), stats, logp_T.grad


def test_clip_higher_positive_advantage():
    # A = +2, r in [0.5, 1.0, 1.25, 1.5]:
    #   r=0.5 : min(0.5*2=1.0, 0.8*2=1.6)  = 1.0  -> loss -1.0, not clipped (below the band only clips A<0)
    #   r=1.0 : min(2.0, 2.0)               = 2.0  -> loss -2.0
    #   r=1.25: min(2.5, 2.5)               = 2.5  -> loss -2.5, not clipped: symmetric eps=0.2 would clip at 1.2
    #   r=1.5 : min(3.0, 1.28*2=2.56)       = 2.56 -> loss -2.56, clipped
    loss_T, stats, grad_T = _objective([0.5, 1.0, 1.25, 1.5], 2.0)
    torch.testing.assert_close(loss_T, torch.tensor([-1.0, -2.0, -2.5, -2.56]))
    assert stats["clipped_T"].tolist() == [False, False, False, True]
    torch.testing.assert_close(stats["ratio_T"], torch.tensor([0.5, 1.0, 1.25, 1.5]))
    # d loss / d logp = -A * r unclipped: -2*0.5, -2*1, -2*1.25; 0 where clipped
    torch.testing.assert_close(grad_T, torch.tensor([-1.0, -2.0, -2.5, 0.0]))


def test_clip_higher_negative_advantage():
    # A = -1, r in [0.5, 0.85, 1.0, 1.5]:
    #   r=0.5 : min(-0.5, 0.8*-1=-0.8)   = -0.8  -> loss 0.8, clipped
    #   r=0.85: min(-0.85, -0.85)        = -0.85 -> loss 0.85
    #   r=1.0 : min(-1.0, -1.0)          = -1.0  -> loss 1.0
    #   r=1.5 : min(-1.5, 1.28*-1=-1.28) = -1.5  -> loss 1.5, not clipped (above the band only clips A>0)
    loss_T, stats, grad_T = _objective([0.5, 0.85, 1.0, 1.5], -1.0)
    torch.testing.assert_close(loss_T, torch.tensor([0.8, 0.85, 1.0, 1.5]))
    assert stats["clipped_T"].tolist() == [True, False, False, False]
    # -A * r = r where unclipped
    torch.testing.assert_close(grad_T, torch.tensor([0.0, 0.85, 1.0, 1.5]))


@pytest.mark.parametrize("adv", [2.0, -1.0])
def test_a_log_ratio_of_100_gives_a_finite_loss_and_gradient(adv):
    """logp - old = 100 on token 1 (off-policy, IcePop off: nothing else bounds it), next to an ordinary token.
    exp(100) overflowed fp32 to inf: for A > 0 the token is clipped, yet exp's backward multiplied the clip's 0 by
    inf and the gradient was NaN; for A < 0 the loss itself was inf. Either way the whole step was skipped. The log is
    clamped at 20 first, so both are finite, the ordinary token is untouched, and the extreme one adds no gradient."""
    logp_T = torch.tensor([-1.0, 0.0], requires_grad=True)
    old_logp_T = torch.tensor([-1.0, -100.0])
    spec = LossSpec()
    loss_T, stats = per_token_objective(logp_T, old_logp_T, torch.tensor(adv), spec)
    loss_T.sum().backward()
    assert bool(torch.isfinite(loss_T).all()) and bool(torch.isfinite(logp_T.grad).all()), (loss_T, logp_T.grad)
    assert stats["ratio_T"][1] == pytest.approx(math.exp(20.0), rel=1e-6)
    # r = exp(20): A > 0 is clipped at 1.28 (loss -1.28 A); A < 0 stays unclipped (loss -r A), a constant past the bound
    expected = -1.28 * adv if adv > 0 else -math.exp(20.0) * adv
    assert float(loss_T.detach()[1]) == pytest.approx(expected, rel=1e-6)
    assert logp_T.grad.tolist() == [-adv, 0.0]  # token 0: r = 1, d loss / d logp = -A


def test_zero_advantage_is_never_clipped():
    loss_T, stats, grad_T = _objective([0.5, 1.0, 2.0], 0.0)
    torch.testing.assert_close(loss_T, torch.zeros(3))
    assert not stats["clipped_T"].any()
    torch.testing.assert_close(grad_T, torch.zeros(3))


def test_per_token_advantages_and_bf16_input():
    # A_T = [+2, -1] at r = [1.5, 0.5]: both clipped -> loss [-2.56, 0.8]; fp32 out whatever comes in
    logp_T = torch.tensor([math.log(1.5), math.log(0.5)], dtype=torch.float64).to(torch.bfloat16).requires_grad_()
    loss_T, stats = per_token_objective(logp_T, torch.zeros(2, dtype=torch.bfloat16), torch.tensor([2.0, -1.0]), SPEC)
    assert loss_T.dtype == torch.float32
    assert stats["clipped_T"].tolist() == [True, True]
    torch.testing.assert_close(loss_T.detach(), torch.tensor([-2.56, 0.8]))
    loss_T.sum().backward()
    torch.testing.assert_close(logp_T.grad.float(), torch.zeros(2))


def test_stats_are_detached_and_kl_zero_without_ref():
    logp_T = torch.tensor([-1.0, -2.0], requires_grad=True)
    _, stats = per_token_objective(logp_T, torch.tensor([-1.0, -2.5]), torch.tensor(1.0), SPEC)
    assert all(not t.requires_grad for t in stats.values())
    assert stats["clipped_T"].dtype == torch.bool
    torch.testing.assert_close(stats["kl_T"], torch.zeros(2))


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="old_logp_T"):
        per_token_objective(torch.zeros(3), torch.zeros(2), torch.tensor(1.0), SPEC)


# ------------------------------------------------------------------------------------------------------------ KL


def test_k3_kl_hand_values_and_gradient():
    # A = 0 so pg = 0 and the loss is kl_coef * kl. With d = ref - logp, kl = e^d - d - 1, d kl / d logp = 1 - e^d.
    #   logp = ref = -0.7      : d = 0       -> kl 0,                             grad 0
    #   logp = 0,  ref = ln 2  : d = ln 2    -> kl 2 - 0.6931472 - 1 = 0.3068528, grad 1 - 2   = -1
    #   logp = ln 2, ref = 0   : d = -ln 2   -> kl 0.5 + 0.6931472 - 1 = 0.1931472, grad 1 - 0.5 = 0.5
    ln2 = math.log(2.0)
    spec = LossSpec(kl_coef=0.1)
    logp_T = torch.tensor([-0.7, 0.0, ln2], requires_grad=True)
    ref_logp_T = torch.tensor([-0.7, ln2, 0.0], requires_grad=True)
    loss_T, stats = per_token_objective(logp_T, logp_T.detach(), torch.tensor(0.0), spec, ref_logp_T=ref_logp_T)
    torch.testing.assert_close(stats["kl_T"], torch.tensor([0.0, 0.3068528, 0.1931472]))
    torch.testing.assert_close(loss_T.detach(), torch.tensor([0.0, 0.03068528, 0.01931472]))
    loss_T.sum().backward()
    torch.testing.assert_close(logp_T.grad, torch.tensor([0.0, -0.1, 0.05]))
    assert ref_logp_T.grad is None


def test_kl_adds_to_pg():
    # r = 1.5, A = +2 -> pg = -2.56 (clipped, grad 0); logp = ln 1.5, ref = 0: d = -ln 1.5 = -0.4054651
    # kl = 1/1.5 + 0.4054651 - 1 = 0.0721318; loss = -2.56 + 0.5 * 0.0721318 = -2.5239341
    # grad = 0 + 0.5 * (1 - 1/1.5) = 0.1666667
    logp_T = torch.tensor([math.log(1.5)], requires_grad=True)
    loss_T, _ = per_token_objective(
        logp_T, torch.zeros(1), torch.tensor(2.0), LossSpec(kl_coef=0.5), ref_logp_T=torch.zeros(1)
    )
    torch.testing.assert_close(loss_T.detach(), torch.tensor([-2.5239341]))
    loss_T.sum().backward()
    torch.testing.assert_close(logp_T.grad, torch.tensor([0.1666667]))


def test_kl_logged_but_not_added_when_coef_zero():
    # logp = 0, ref = ln 2: kl = 0.3068528 in stats; r = 1, A = 1 -> loss = -1 exactly
    loss_T, stats = per_token_objective(
        torch.zeros(1), torch.zeros(1), torch.tensor(1.0), SPEC, ref_logp_T=torch.tensor([math.log(2.0)])
    )
    torch.testing.assert_close(stats["kl_T"], torch.tensor([0.3068528]))
    torch.testing.assert_close(loss_T, torch.tensor([-1.0]))


def test_kl_without_ref_raises():
    with pytest.raises(ValueError, match="ref_logp_T"):
        per_token_objective(torch.zeros(2), torch.zeros(2), torch.tensor(1.0), LossSpec(kl_coef=0.1))


# --------------------------------------------------------------------------------------------------- aggregation

# Two sequences: a = [1, 2] (len 2, sum 3, mean 1.5) and b = [3, 4, 5] (len 3, sum 12, mean 4); 5 tokens, sum 15.
SEQ_A = [1.0, 2.0]
SEQ_B = [3.0, 4.0, 5.0]


@pytest.mark.parametrize(
    ("spec", "expected_loss", "expected_w"),
    [
        # 15 / 5 = 3; w = 1/5 each
        (LossSpec(agg="token-mean"), 3.0, [0.2, 0.2]),
        # (1.5 + 4) / 2 = 2.75; w = 1/(2*2) = 0.25, 1/(3*2) = 0.1666667
        (LossSpec(agg="seq-mean-token-mean"), 2.75, [0.25, 1.0 / 6.0]),
        # 15 / (2 seqs * C=4) = 1.875; w = 1/8 each
        (LossSpec(agg="constant", norm_constant=4), 1.875, [0.125, 0.125]),
    ],
    ids=["token-mean", "seq-mean-token-mean", "constant"],
)
def test_aggregation_modes_two_sequences(spec, expected_loss, expected_w):
    w_S = token_weights([2, 3], spec, total_tokens=5, total_seqs=2)
    assert w_S.dtype == torch.float32
    torch.testing.assert_close(w_S, torch.tensor(expected_w))
    loss = aggregate([torch.tensor(SEQ_A), torch.tensor(SEQ_B)], spec)
    torch.testing.assert_close(loss, torch.tensor(expected_loss))
    # lengths as a tensor work the same
    torch.testing.assert_close(token_weights(torch.tensor([2, 3]), spec, 5, 2), w_S)


# Two "ranks": rank 0 holds a, b above; rank 1 holds c = [6] and d = [0, 1, 1, 2] (sum 4, mean 1).
# Global: 4 sequences, 2 + 3 + 1 + 4 = 10 tokens, sum 3 + 12 + 6 + 4 = 25.
RANKS = [[SEQ_A, SEQ_B], [[6.0], [0.0, 1.0, 1.0, 2.0]]]


@pytest.mark.parametrize(
    ("spec", "expected_loss", "expected_w"),
    [
        # 25 / 10 = 2.5; every token's gradient is 1/10
        (LossSpec(agg="token-mean"), 2.5, [0.1, 0.1, 0.1, 0.1]),
        # (1.5 + 4 + 6 + 1) / 4 = 3.125; w = 1/(len * 4) = 1/8, 1/12, 1/4, 1/16
        (LossSpec(agg="seq-mean-token-mean"), 3.125, [0.125, 1.0 / 12.0, 0.25, 0.0625]),
        # 25 / (4 * 4) = 1.5625; w = 1/16 each
        (LossSpec(agg="constant", norm_constant=4), 1.5625, [0.0625] * 4),
    ],
    ids=["token-mean", "seq-mean-token-mean", "constant"],
)
def test_weights_decompose_across_ranks_and_backwards(spec, expected_loss, expected_w):
    """The key property: per-rank, per-response backwards weighted by global-count weights sum to the global loss
    and accumulate to its gradient."""
    flat = [seq for rank in RANKS for seq in rank]
    leaves = [torch.tensor(seq, requires_grad=True) for seq in flat]
    global_loss = aggregate(leaves, spec)
    torch.testing.assert_close(global_loss.detach(), torch.tensor(expected_loss))
    global_loss.backward()
    global_grads = [leaf.grad.clone() for leaf in leaves]

    split_leaves, total = [], torch.zeros(())
    for rank in RANKS:  # each rank sees only its own lengths, plus the global counts
        w_S = token_weights([len(seq) for seq in rank], spec, total_tokens=10, total_seqs=4)
        for w, seq in zip(w_S, rank, strict=True):
            leaf = torch.tensor(seq, requires_grad=True)
            part = w * leaf.sum()
            part.backward()  # one independent backward per response
            total = total + part.detach()
            split_leaves.append(leaf)
    torch.testing.assert_close(total, torch.tensor(expected_loss))
    for leaf, grad, w in zip(split_leaves, global_grads, expected_w, strict=True):
        torch.testing.assert_close(leaf.grad, grad)
        torch.testing.assert_close(leaf.grad, torch.full_like(grad, w))  # d L / d loss_t = w_s


def test_zero_length_sequence_gets_zero_weight():
    # seq-mean-token-mean would divide by len = 0; token-mean: 1/5 for the others
    for spec in (LossSpec(agg="seq-mean-token-mean"), LossSpec(agg="token-mean")):
        w_S = token_weights([2, 0, 3], spec, total_tokens=5, total_seqs=3)
        assert w_S[1].item() == 0.0
    # aggregate with an empty sequence, token-mean: still 15 / 5 = 3
    loss = aggregate([torch.tensor(SEQ_A), torch.zeros(0), torch.tensor(SEQ_B)], LossSpec())
    torch.testing.assert_close(loss, torch.tensor(3.0))
    torch.testing.assert_close(aggregate([], LossSpec()), torch.tensor(0.0))
    torch.testing.assert_close(aggregate([torch.zeros(0)], LossSpec()), torch.tensor(0.0))


def test_token_weights_reject_local_counts_above_global():
    with pytest.raises(ValueError, match="exceed"):
        token_weights([2, 3], LossSpec(), total_tokens=4, total_seqs=2)
    with pytest.raises(ValueError, match="exceed"):
        token_weights([2, 3], LossSpec(), total_tokens=5, total_seqs=1)


def test_end_to_end_group_at_a_time_equals_global():
    """Objective + weights over 2 groups of 2 responses, one backward per response, vs one global backward."""
    torch.manual_seed(0)
    spec = LossSpec(agg="seq-mean-token-mean", kl_coef=0.05)
    lengths = [3, 5, 2, 4]
    adv = group_advantages_batch(torch.tensor([[1.0, 0.0], [0.0, 2.0]])).flatten()
    logp = [(-torch.rand(n)).requires_grad_() for n in lengths]
    old = [lp.detach() + 0.3 * torch.randn(n) for lp, n in zip(logp, lengths, strict=True)]
    ref = [lp.detach() + 0.1 * torch.randn(n) for lp, n in zip(logp, lengths, strict=True)]

    losses = [per_token_objective(logp[i], old[i], adv[i], spec, ref[i])[0] for i in range(4)]
    aggregate(losses, spec).backward()
    global_grads = [lp.grad.clone() for lp in logp]
    for lp in logp:
        lp.grad = None

    for group in ([0, 1], [2, 3]):
        w_S = token_weights([lengths[i] for i in group], spec, total_tokens=sum(lengths), total_seqs=4)
        for w, i in zip(w_S, group, strict=True):
            loss_T, _ = per_token_objective(logp[i], old[i], adv[i], spec, ref[i])
            (w * loss_T.sum()).backward()
    for lp, grad in zip(logp, global_grads, strict=True):
        torch.testing.assert_close(lp.grad, grad)


def test_masked_mean():
    # (1 + 3) / 2 = 2; the NaN sits under the mask and must not leak
    x = torch.tensor([1.0, float("nan"), 3.0])
    torch.testing.assert_close(masked_mean(x, torch.tensor([True, False, True])), torch.tensor(2.0))
    torch.testing.assert_close(masked_mean(x, torch.zeros(3, dtype=torch.bool)), torch.tensor(0.0))


# ------------------------------------------------------------------------------------------------------ LossSpec


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(agg="token_mean"), r"loss\.agg: unknown mode 'token_mean' \(did you mean 'token-mean'\?\)"),
        (dict(agg="sum"), r"loss\.agg: unknown mode 'sum'"),
        (dict(eps_low=-0.1), r"loss\.eps_low: must be >= 0"),
        (dict(eps_high=-0.1), r"loss\.eps_high: must be >= 0"),
        (dict(eps_low=1.0), r"loss\.eps_low: must be < 1"),
        (dict(kl_coef=-1.0), r"loss\.kl_coef"),
        (dict(eps_high=float("nan")), r"loss\.eps_high: must be a finite number"),
        (dict(agg="constant"), r"loss\.norm_constant: agg=constant needs norm_constant > 0"),
        (dict(norm_constant=-5), r"loss\.norm_constant: must be an int >= 0"),
        (dict(norm_constant=4.5), r"loss\.norm_constant: must be an int >= 0"),
    ],
)
def test_loss_spec_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match) as info:
        LossSpec(**kwargs)
    assert "\n" not in str(info.value)


def test_loss_spec_defaults_frozen_help_and_pickle():
    spec = LossSpec()
    assert (spec.eps_low, spec.eps_high, spec.agg, spec.norm_constant, spec.kl_coef) == (0.2, 0.28, "token-mean", 0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.eps_low = 0.1
    assert all(f.metadata.get("help") for f in dataclasses.fields(LossSpec))
    # LossSpec crosses the Ray boundary to the learners
    spec = LossSpec(agg="constant", norm_constant=1024, kl_coef=0.01)
    assert pickle.loads(pickle.dumps(spec)) == spec
