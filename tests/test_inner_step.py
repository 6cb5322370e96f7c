"""The learner's inner steps on one group, under real DeepSpeed (one in-process rank, gloo).

Every test here builds its learner with `LearnerActor.setup`, the code a Ray learner rank runs, so each backward goes
through DeepSpeed's engine.backward: the path the trainer takes. (An earlier stand-in engine whose backward
was a plain loss.backward() hid a defect under fp16 loss scaling.)
"""

from __future__ import annotations

import dataclasses
import math
import socket

import pytest
import torch

from longstraw.memory import TensorPeak
from mint.config import build_config
from mint.rl.grpo import per_token_objective
from mint.train.inner_step import (
    GroupBatch,
    GroupObjective,
    MicroStep,
    StepContext,
    StepPlan,
    _score_padded,
    _statuses,
    deepspeed_loss_scale,
    longstraw_group_step,
    loss_spec,
    naive_group_step,
)
from mint.train.learner import LearnerActor
from mint.train.preflight import cpu_fp16_supported


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def real_learner(path: str, overrides: list[str], dtype: str = "float32", faults=None) -> LearnerActor:
    """A world-size-1 learner rank set up exactly as a Ray rank is, with LoRA B perturbed so every LoRA matrix gets
    a gradient (B starts at zero). The recipe's default ZeRO stage; gradients are read back with DeepSpeed's
    safe_get_full_grad. `faults`: mint.train.faults.Faults to inject."""
    config = build_config({}, ["learner.num_ranks=1", "ray.torch_threads=1", *overrides])
    if dtype != config.model.dtype:
        # Recipes refuse float16 on a CPU learner (slow, and no GPU run uses it there); DeepSpeed's fp16 optimizer
        # and loss scaling run on CPU all the same, which is what the fp16 test needs.
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype))
    learner = LearnerActor(config, path, 0, 1, faults)
    learner.setup("127.0.0.1", _free_port())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in learner.engine.module.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return learner


def _group(routes_ok: bool = True) -> GroupBatch:
    gen = torch.Generator().manual_seed(1)
    prompt = torch.tensor([3, 9, 27, 81, 5])
    responses = [torch.tensor([7, 11, 13]), torch.tensor([17, 19])]
    prompt_routes = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(4 * 2)]).view(4, 2, 2)
    routes = [
        torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(len(r) * 2)]).view(len(r), 2, 2)
        for r in responses
    ]
    if not routes_ok:
        routes[0][1, 0] = torch.tensor([5, 0])  # response 0, token 1: expert 5 of 4
    return GroupBatch(
        prompt,
        responses,
        [torch.full((len(r),), -2.0) for r in responses],
        torch.tensor([1.0, -1.0]),
        prompt_routes.to(torch.uint8),
        [r.to(torch.uint8) for r in routes],
    )


def _lora_grads(learner: LearnerActor) -> torch.Tensor:
    """The LoRA gradient accumulated since the last zero_grad, as DeepSpeed holds it (x the loss scale under fp16)."""
    from deepspeed.utils import safe_get_full_grad

    params = [p for p in learner.engine.module.parameters() if p.requires_grad]
    return torch.cat([safe_get_full_grad(p).flatten().float() for p in params])


def _one(group: GroupBatch) -> tuple[MicroStep, StepPlan]:
    plan = StepPlan([MicroStep(group, True)], total_tokens=sum(group.lengths), total_seqs=len(group.responses))
    return plan.micro_steps[0], plan


def test_excluded_tokens_contribute_zero_gradient(random_qwen3_path):
    """The learner's masked loss has the gradient of the same loss with the bad token's term removed by hand."""
    learner = real_learner(random_qwen3_path, ["grpo.icepop=false"])
    group = _group(routes_ok=False)
    micro, plan = _one(group)
    stats, _ = naive_group_step(learner.ctx, micro, plan, None, last=True)
    assert stats["trust"].masked["route_out_of_range"] == 1 and stats["trust"].kept == 4
    grads = _lora_grads(learner)
    learner.engine.optimizer.zero_grad()

    # By hand: same replayed forward (the bad position falls back to native routing), per-token objective,
    # and token 1 of response 0 dropped explicitly.
    logp, _ = _score_padded(learner.ctx, group, with_grad=True, routes=learner.ctx.group_routes(group))
    manual = 0.0
    for i, logp_R in enumerate(logp):
        loss_R, _ = per_token_objective(logp_R, logp_R.detach(), group.adv_G[i].expand_as(logp_R), learner.ctx.spec)
        keep = torch.ones_like(loss_R)
        if i == 0:
            keep[1] = 0.0
        manual = manual + (loss_R * keep).sum() / 5
    learner.engine.backward(manual)
    assert torch.allclose(grads, _lora_grads(learner), atol=1e-7)
    assert stats["loss"] == pytest.approx(float(manual.detach()), abs=1e-7)


def test_bad_route_payloads_are_counted_never_a_crash(random_qwen3_path):
    learner = real_learner(random_qwen3_path, ["grpo.icepop=false", "longstraw.mode=exact"])
    good = _group()
    cases = {
        "route_missing": GroupBatch(good.prompt_tokens_P, good.responses, good.rollout_logprobs, good.adv_G),
        "route_layout": GroupBatch(
            good.prompt_tokens_P,
            good.responses,
            good.rollout_logprobs,
            good.adv_G,
            good.prompt_routes_P1_L_K.float(),
            [r.float() for r in good.routes],
        ),
        "route_layers": GroupBatch(
            good.prompt_tokens_P,
            good.responses,
            good.rollout_logprobs,
            good.adv_G,
            good.prompt_routes_P1_L_K[:, :1],
            [r[:, :1] for r in good.routes],
        ),
    }
    for reason, group in cases.items():
        micro, plan = _one(group)
        for inner_step in (naive_group_step, longstraw_group_step):
            learner.engine.optimizer.zero_grad()
            stats, _ = inner_step(learner.ctx, micro, plan, None, last=True)
            assert stats["trust"].masked[reason] == 5 and stats["trust"].kept == 0, reason
            assert stats["loss"] == 0.0
            assert float(_lora_grads(learner).abs().sum()) == 0.0


@pytest.mark.parametrize("r3", ["true", "false"])
def test_longstraw_exact_step_equals_the_naive_step(random_tiny_path, r3):
    """Same group, same objective (trust mask, KL), both through DeepSpeed's backward: LongStraw exact gradients =
    the padded full-sequence step."""
    overrides = [
        "longstraw.mode=exact",
        "longstraw.chunk_size=2",
        "grpo.kl_coef=0.05",
        f"grpo.r3={r3}",
        "grpo.icepop=false",
    ]
    learner = real_learner(random_tiny_path, overrides)
    micro, plan = _one(_group(routes_ok=False))
    naive_stats, naive_logp = naive_group_step(learner.ctx, micro, plan, None, last=True)
    naive = _lora_grads(learner)
    learner.engine.optimizer.zero_grad()
    ls_stats, ls_logp = longstraw_group_step(learner.ctx, micro, plan, None, last=True)
    assert torch.allclose(_lora_grads(learner), naive, atol=1e-6, rtol=1e-4)
    for a, b in zip(ls_logp, naive_logp, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert ls_stats["loss"] == pytest.approx(naive_stats["loss"], abs=1e-6)
    assert ls_stats["kl"] == pytest.approx(naive_stats["kl"], rel=1e-4, abs=1e-9)
    a, b = ls_stats["trust"], naive_stats["trust"]
    # With R3 the bad-route token is out (R3 off: nothing is excluded for routes); the rest carry gradient.
    assert a.kept == (4 if r3 == "true" else 5) and float(naive.abs().sum()) > 0
    assert (a.kept, a.masked, a.routed, a.out_of_route) == (b.kept, b.masked, b.routed, b.out_of_route)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


@pytest.mark.skipif(
    not cpu_fp16_supported(),
    reason="fp16 unsupported on this CPU: DeepSpeed's CPU accelerator (oneDNN) finds no AVX-512-FP16 or AMX-FP16, "
    "and the learner here runs on it",
)
def test_exact_mode_under_the_fp16_loss_scale_equals_the_naive_step(random_qwen3_path):
    """With fp16, DeepSpeed multiplies every loss by its loss scale S before backward. LongStraw's prompt
    backward runs a surrogate built from the dK/dV its replays accumulated (already x S); scaled again, the prompt
    path came out S times too large (cosine 0.16 at S=1024). Here S=1024 and the exact step must match the naive
    step, which has no surrogate."""
    learner = real_learner(random_qwen3_path, ["longstraw.mode=exact", "grpo.icepop=false"], dtype="float16")
    learner.engine.optimizer.loss_scale = 1024.0
    assert deepspeed_loss_scale(learner.engine) == 1024.0
    micro, plan = _one(_group())
    naive_group_step(learner.ctx, micro, plan, None, last=True)
    naive = _lora_grads(learner)
    learner.engine.optimizer.zero_grad()
    longstraw_group_step(learner.ctx, micro, plan, None, last=True)
    exact = _lora_grads(learner)
    assert bool(torch.isfinite(exact).all()) and float(naive.norm()) > 0
    # fp16 forward noise is ~1e-3 relative; the defect was a factor of S on the prompt path.
    assert _cosine(exact, naive) > 0.999
    assert float(exact.norm() / naive.norm()) == pytest.approx(1.0, abs=0.01)

    # And the scale really was applied: the fp16 gradients are S x the fp32 learner's.
    fp32 = real_learner(random_qwen3_path, ["longstraw.mode=exact", "grpo.icepop=false"])
    naive_group_step(fp32.ctx, micro, plan, None, last=True)
    reference = _lora_grads(fp32)
    assert _cosine(naive / 1024.0, reference) > 0.999
    assert float((naive / 1024.0).norm() / reference.norm()) == pytest.approx(1.0, abs=0.02)


# Stale rollout logprobs that the trust mask drops (ratio_high, non_finite, ratio_low): (response, token) -> logprob.
STALE = {(0, 1): -100.0, (1, 0): -math.inf, (0, 3): 50.0}


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_masked_token_with_rollout_logprob_minus_100_or_inf_adds_nothing_not_nan(adv):
    """Off-policy objective (rollout.max_staleness=1, the ratio against the rollout's logprobs): the rollout gave
    tokens 1, 2, 3 logprobs -100, -inf and +50 where the learner has about -2, and the trust mask drops all three. The
    ratio was formed unclamped and the mask multiplied afterwards: exp(98) = inf, so the loss was inf x 0 = nan for
    A < 0 and the gradient 0 x inf = nan for either sign. Weight 0 must mean absent: value and gradient equal the
    objective of the kept tokens alone, and the masked tokens' gradient is exactly 0."""
    config = build_config({}, ["rollout.max_staleness=1", "grpo.kl_coef=0.05", "grpo.r3=false"])
    ctx = StepContext(None, config, loss_spec(config), None, torch.device("cpu"), 1)
    rollout_R = torch.tensor([-2.1, -100.0, -math.inf, 50.0, -1.4])
    ref_R = torch.tensor([-2.2, -1.0, -3.0, -0.5, -1.6])
    group = GroupBatch(torch.tensor([3, 9, 27]), [torch.tensor([7, 11, 13, 17, 19])], [rollout_R], torch.tensor([adv]))
    plan = StepPlan([MicroStep(group, True)], total_tokens=5, total_seqs=1)
    objective = GroupObjective(ctx, group, plan, _statuses(group, None))
    logp_R = torch.tensor([-2.0, -2.0, -2.0, -1.5, -1.5], requires_grad=True)
    loss = objective.response_loss(0, logp_R, ref_R, None, None)
    loss.backward()
    trust = objective.stats()["trust"]
    # -inf is not a drift but a broken log-prob: non_finite, not ratio_high
    masked = trust.masked
    assert (trust.kept, masked["ratio_high"], masked["ratio_low"], masked["non_finite"]) == (2, 1, 1, 1)
    assert math.isfinite(float(loss.detach())) and bool(torch.isfinite(logp_R.grad).all())
    assert logp_R.grad[1:4].tolist() == [0.0, 0.0, 0.0]

    kept = torch.tensor([0, 4])
    logp_K = logp_R.detach()[kept].requires_grad_()
    loss_K, st = per_token_objective(logp_K, rollout_R[kept], torch.tensor(adv), ctx.spec, ref_logp_T=ref_R[kept])
    absent = loss_K.sum() / 5  # token-mean over all 5 tokens: a masked token stays in the normalizer
    absent.backward()
    # The same fp32 ops on the same values: equal up to the sum's order.
    assert float(loss.detach()) == pytest.approx(float(absent.detach()), abs=1e-7)
    assert torch.allclose(logp_R.grad[kept], logp_K.grad, atol=1e-7)
    assert objective.stats()["kl"] == pytest.approx(float(st["kl_T"].sum()), abs=1e-7)


@pytest.mark.parametrize("staleness", [0, 1])
def test_truncated_importance_sampling_weights_the_policy_gradient_by_the_capped_rollout_ratio(staleness):
    """grpo.tis_cap = 2 on-policy: each kept token's policy-gradient term is weighted by min(pi_learner / pi_rollout,
    2) from the learner's first pass (the KL term is not), so the gradient is w_t x the unweighted one's PG part.
    Off-policy (max_staleness 1) the PPO ratio is already against the rollout's logprobs: no weight."""
    overrides = [f"rollout.max_staleness={staleness}", "grpo.kl_coef=0.05", "grpo.r3=false", "grpo.icepop=false"]
    rollout_R = torch.tensor([-2.0, -3.0, -1.0, -2.5])
    old_R = torch.tensor([-2.2, -1.0, -1.1, -2.5])  # ratios exp(-0.2), exp(2) -> capped at 2, exp(-0.1), 1
    ref_R = torch.tensor([-2.1, -1.2, -1.0, -2.4])
    group = GroupBatch(torch.tensor([3, 9, 27]), [torch.tensor([7, 11, 13, 17])], [rollout_R], torch.tensor([1.0]))
    plan = StepPlan([MicroStep(group, True)], total_tokens=4, total_seqs=1)
    grads = {}
    for cap in (0.0, 2.0):
        config = build_config({}, [*overrides, f"grpo.tis_cap={cap}"])
        ctx = StepContext(None, config, loss_spec(config), None, torch.device("cpu"), 1)
        objective = GroupObjective(ctx, group, plan, _statuses(group, None))
        logp_R = old_R.clone().requires_grad_()
        objective.response_loss(0, logp_R, ref_R, [old_R], None).backward()
        grads[cap] = logp_R.grad
    if staleness:
        assert torch.equal(grads[2.0], grads[0.0])
        return
    delta = ref_R - old_R
    kl_grad = 0.05 * -(torch.exp(delta) - 1.0) / 4  # d/dlogp of the k3 KL, token-mean over 4 tokens
    weight = torch.exp(old_R - rollout_R).clamp(max=2.0)
    torch.testing.assert_close(grads[2.0] - kl_grad, weight * (grads[0.0] - kl_grad))
    assert weight[1] == 2.0 and not torch.equal(grads[2.0], grads[0.0])


def _stale_group(learner: LearnerActor, adv: float) -> GroupBatch:
    """Prompt 17, responses 4 and 3 (the shape of the failing qwen3 step). Rollout logprobs are the learner's own
    (ratio 1, kept) except the STALE tokens, which IcePop masks."""
    gen = torch.Generator().manual_seed(2)
    vocab = learner.engine.module.config.vocab_size
    prompt = torch.randint(vocab, (17,), generator=gen)
    responses = [torch.randint(vocab, (n,), generator=gen) for n in (4, 3)]
    group = GroupBatch(prompt, responses, [torch.zeros(len(r)) for r in responses], torch.tensor([adv, -adv / 2]))
    own, _ = _score_padded(learner.ctx, group, with_grad=False, routes=learner.ctx.group_routes(group))
    rollout = [lp.detach().clone() for lp in own]
    for (i, j), value in STALE.items():
        rollout[i][j] = value
    return dataclasses.replace(group, rollout_logprobs=rollout)


@pytest.mark.parametrize("adv", [1.0, -1.0])
@pytest.mark.parametrize("inner_step", [naive_group_step, longstraw_group_step], ids=["naive", "longstraw"])
def test_stale_step_with_rollout_logprob_minus_100_or_inf_has_finite_grads_equal_to_dropping_them(
    random_qwen3_path, inner_step, adv
):
    """A learner step under rollout.max_staleness=1 (real DeepSpeed), prompt 17 and responses 4 and 3, where the
    rollout gave three tokens logprobs -100, -inf and +50 and IcePop masked them. Every LoRA gradient of this
    step went nan (all 36 tensors on qwen3, so the step was skipped), and the loss too for a negative advantage.
    Now the loss and every gradient are finite and equal those of the same batch with the three tokens left out of
    the loss by hand, for both signs of the advantage, in the naive and the LongStraw (exact) steps."""
    overrides = ["rollout.max_staleness=1", "grpo.r3=false", "grpo.kl_coef=0.05", "longstraw.mode=exact"]
    learner = real_learner(random_qwen3_path, overrides)
    group = _stale_group(learner, adv)
    micro, plan = _one(group)
    stats, _ = inner_step(learner.ctx, micro, plan, None, last=True)
    assert stats["trust"].kept == 4 and sum(stats["trust"].masked.values()) == 3
    from deepspeed.utils import safe_get_full_grad

    lora = [p for p in learner.engine.module.parameters() if p.requires_grad]
    assert all(bool(torch.isfinite(safe_get_full_grad(p)).all()) for p in lora)
    assert math.isfinite(stats["loss"])
    grads = _lora_grads(learner)
    learner.engine.optimizer.zero_grad()

    # By hand: the full-sequence logprobs, the per-token objective on the kept tokens only, token-mean over all 7.
    routes = learner.ctx.group_routes(group)
    logp, _ = _score_padded(learner.ctx, group, with_grad=True, routes=routes)
    ref, _ = _score_padded(learner.ctx, group, with_grad=False, adapter=False, routes=routes)
    manual = 0.0
    for i, logp_R in enumerate(logp):
        keep = torch.tensor([(i, j) not in STALE for j in range(len(logp_R))])
        loss_K, _ = per_token_objective(
            logp_R[keep], group.rollout_logprobs[i][keep], group.adv_G[i], learner.ctx.spec, ref[i][keep]
        )
        manual = manual + loss_K.sum() / 7
    learner.engine.backward(manual)
    assert float(grads.abs().sum()) > 0
    # fp32; LongStraw exact is held to the naive step at this tolerance (test_longstraw_exact_step_equals_...).
    assert torch.allclose(grads, _lora_grads(learner), atol=1e-6, rtol=1e-4)
    assert stats["loss"] == pytest.approx(float(manual.detach()), abs=1e-6)


def _sized_group(vocab: int, prompt_len: int, lengths: tuple[int, ...], seed: int) -> GroupBatch:
    gen = torch.Generator().manual_seed(seed)
    responses = [torch.randint(vocab, (n,), generator=gen) for n in lengths]
    adv = torch.linspace(1.0, -1.0, len(lengths)) if len(lengths) > 1 else torch.ones(1)
    return GroupBatch(
        torch.randint(vocab, (prompt_len,), generator=gen), responses, [torch.zeros(n) for n in lengths], adv
    )


def test_step_peak_of_a_larger_first_group_and_a_smaller_second_is_the_first_groups(random_qwen3_path):
    """A LongStraw learner step of two groups, the first the larger (prompt 48, three responses of 16, exact
    mode) and the second tiny (prompt 3, one token). grpo_update reset the device's peak for every group, so the
    step's peak (read once after the step: max_memory_allocated on CUDA) was the second group's. Metered here by
    the CPU TensorPeak, which sees every reset_peak as CUDA's counter does: the step's peak must be at least the
    first group's own."""
    learner = real_learner(random_qwen3_path, ["grpo.icepop=false", "grpo.r3=false", "longstraw.mode=exact"])
    vocab = learner.engine.module.config.vocab_size
    big, small = _sized_group(vocab, 48, (16, 16, 16), 3), _sized_group(vocab, 3, (1,), 4)
    plan = StepPlan([MicroStep(big, True), MicroStep(small, True)], total_tokens=49, total_seqs=4)

    # No accumulation boundary: at the boundary ZeRO's reduction allocates its 5e8-element bucket (2 GB) and that
    # would be every step's peak; the groups' own work is what a reset may hide.
    def step() -> None:
        for micro in plan.micro_steps:
            longstraw_group_step(learner.ctx, micro, plan, None, last=False)
        learner.engine.optimizer.zero_grad()

    step()  # the first backward allocates the gradients; measure steady steps
    alone = {}
    for name, micro in (("big", plan.micro_steps[0]), ("small", plan.micro_steps[1])):
        with TensorPeak() as meter:
            longstraw_group_step(learner.ctx, micro, plan, None, last=False)
        learner.engine.optimizer.zero_grad()
        alone[name] = meter.nbytes
    with TensorPeak() as meter:
        step()
    # Measured 561 KB and 156 KB. The slack (64 KiB, for bookkeeping that may differ between a lone group and a
    # step) is far below their gap; with the per-group reset the step read exactly the second group's 156 KB.
    slack = 64 * 1024
    assert alone["big"] > alone["small"] + 4 * slack, alone
    assert abs(meter.nbytes - alone["big"]) <= slack, (meter.nbytes, alone)


def test_a_nan_rollout_logprob_is_masked_non_finite_and_the_off_policy_step_is_not_skipped(random_qwen3_path):
    """A whole learner step (real DeepSpeed, ZeRO-1) under rollout.max_staleness=1 with IcePop on, where the rollout
    reported NaN for one token. NaN compares false with both band edges, so IcePop kept it "in band", the PPO ratio
    against the rollout's logprob made the loss NaN, every gradient went NaN and the step was skipped (the run then
    stopped blaming learner.lr). Now the token is masked under its own reason, non_finite, and the step is taken
    with the other tokens."""
    learner = real_learner(random_qwen3_path, ["rollout.max_staleness=1", "grpo.r3=false", "learner.inner_step=naive"])
    group = _stale_group(learner, 1.0)
    own, _ = _score_padded(learner.ctx, group, with_grad=False, routes=learner.ctx.group_routes(group))
    rollout = [lp.detach().clone() for lp in own]  # every other token exactly in band (ratio 1)
    rollout[0][2] = float("nan")
    group = dataclasses.replace(group, rollout_logprobs=rollout)
    plan = StepPlan([MicroStep(group, True)], total_tokens=sum(group.lengths), total_seqs=len(group.lengths), step=1)
    before = _lora_weights(learner)
    sums = learner.step(plan)
    assert not sums["skipped"] and not sums["bad"], sums
    assert math.isfinite(sums["loss"]) and math.isfinite(sums["grad_norm"]), sums
    trust = sums["trust"]
    assert trust.masked["non_finite"] == 1 and sum(trust.masked.values()) == trust.tokens - trust.kept
    assert trust.metrics()["trust_dropped_non_finite"] == pytest.approx(1 / 7)
    assert not torch.equal(before, _lora_weights(learner)), "the step changed nothing"


def _lora_weights(learner: LearnerActor) -> torch.Tensor:
    params = [p for p in learner.engine.module.parameters() if p.requires_grad]
    return torch.cat([p.detach().flatten().float().clone() for p in params])
