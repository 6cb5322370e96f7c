"""The learner's inner steps on one group, under real DeepSpeed (one in-process rank, gloo) (issues 5 and 9).

Every test here builds its learner with `LearnerActor.setup`, the code a Ray learner rank runs, so each backward goes
through DeepSpeed's engine.backward: the path the trainer takes. (Issue 9: an earlier stand-in engine whose backward
was a plain loss.backward() hid a defect under fp16 loss scaling.)
"""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch

from mint.config import build_config
from mint.rl.grpo import per_token_objective
from mint.train.inner_step import (
    GroupBatch,
    MicroStep,
    StepPlan,
    _score_padded,
    deepspeed_loss_scale,
    longstraw_group_step,
    naive_group_step,
)
from mint.train.learner import LearnerActor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def real_learner(path: str, overrides: list[str], dtype: str = "float32") -> LearnerActor:
    """A world-size-1 learner rank set up exactly as a Ray rank is, with LoRA B perturbed so every LoRA matrix gets
    a gradient (B starts at zero). The recipe's default ZeRO stage; gradients are read back with DeepSpeed's
    safe_get_full_grad."""
    config = build_config({}, ["learner.num_ranks=1", "ray.torch_threads=1", *overrides])
    if dtype != config.model.dtype:
        # Recipes refuse float16 on a CPU learner (slow, and no GPU run uses it there); DeepSpeed's fp16 optimizer
        # and loss scaling run on CPU all the same, which is what the fp16 test needs.
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype))
    learner = LearnerActor(config, path, 0, 1)
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


def test_exact_mode_under_the_fp16_loss_scale_equals_the_naive_step(random_qwen3_path):
    """Issue 9: with fp16, DeepSpeed multiplies every loss by its loss scale S before backward. LongStraw's prompt
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
