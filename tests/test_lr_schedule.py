"""The learning rate follows the GRPO step count, under real DeepSpeed (one in-process rank on gloo, set up by
`LearnerActor.setup` as a Ray rank is).

DeepSpeed's lr scheduler used to drive the rate. It advances once per engine.step() that applies, so with
learner.epochs = 2 the schedule ran twice as fast as grpo.steps (epoch 1 of step t used step t + 1's rate, and the
logged `lr` was epoch 0's), and a step skipped for a non-finite gradient did not advance it, so every later step took
the rate of the step before. The rate is now set at each step from `lr_factor(step - 1)`.
"""

from __future__ import annotations

import pytest
import torch
from test_inner_step import real_learner

from mint.train.faults import Faults
from mint.train.inner_step import GroupBatch, MicroStep, StepPlan
from mint.train.learner import LearnerActor, lr_factor

SCHEDULE = ["learner.lr_schedule=cosine", "learner.min_lr_ratio=0.1", "learner.lr=0.01", "grpo.steps=5"]


def _learner(path: str, overrides: list[str], faults: Faults | None = None) -> LearnerActor:
    """A world-size-1 rank of the naive step (test_inner_step.real_learner), IcePop off."""
    return real_learner(path, ["learner.inner_step=naive", "grpo.icepop=false", *overrides], faults=faults)


def _plan(step: int) -> StepPlan:
    """One prompt, two responses with opposite advantages, routes for the tiny MoE's 2 layers x top-2 of 4."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.tensor([3, 9, 27, 81, 5])
    responses = [torch.tensor([7, 11, 13]), torch.tensor([17, 19])]

    def routes(n: int) -> torch.Tensor:
        return torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(n * 2)]).view(n, 2, 2).to(torch.uint8)

    group = GroupBatch(
        prompt,
        responses,
        [torch.full((len(r),), -2.0) for r in responses],
        torch.tensor([1.0, -1.0]),
        routes(4),
        [routes(len(r)) for r in responses],
    )
    return StepPlan([MicroStep(group, True)], total_tokens=sum(group.lengths), total_seqs=2, step=step)


def _lora(learner: LearnerActor) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in learner.engine.module.parameters() if p.requires_grad])


def _record_updates(learner: LearnerActor) -> list[tuple[float, torch.Tensor]]:
    """Every engine.step() from now on appends (the rate the optimizer held for it, the LoRA weights after it). A
    spy around the real call: DeepSpeed still runs the step."""
    seen: list[tuple[float, torch.Tensor]] = []
    apply = learner.engine.step

    def step_and_record(*args, **kwargs):
        lr = float(learner.engine.get_lr()[0])
        apply(*args, **kwargs)
        seen.append((lr, _lora(learner)))

    learner.engine.step = step_and_record
    return seen


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_two_epochs_take_their_steps_rate_and_both_update_the_adapter(random_qwen3_path, zero_stage):
    """learner.epochs = 2 with 2 warmup steps and a cosine over 5 steps: both epochs of step t use lr x
    lr_factor(t - 1) and the logged lr is that rate (before, epoch 1 took step t + 1's rate and the schedule reached
    its floor at step 3), and each epoch's optimizer step moves the adapter."""
    overrides = [*SCHEDULE, "learner.epochs=2", "learner.warmup_steps=2", f"learner.zero_stage={zero_stage}"]
    learner = _learner(random_qwen3_path, overrides)
    factor, lr = lr_factor(learner.config), learner.config.learner.lr
    seen = _record_updates(learner)
    before = _lora(learner)
    for step in range(1, 6):
        sums = learner.step(_plan(step))
        want = lr * factor(step - 1)
        assert not sums["skipped"]
        assert sums["lr"] == pytest.approx(want, rel=1e-12), step
        epochs = seen[2 * (step - 1) :]
        assert [r for r, _ in epochs] == pytest.approx([want, want], rel=1e-12), step
        for _, after in epochs:
            assert not torch.equal(after, before), f"step {step}: an epoch left the adapter unchanged"
            before = after
    assert len(seen) == 10
    # The schedule itself: warmup 0.5, 1.0, then the cosine from 1.0 at step 3 to min_lr_ratio at step 5.
    assert [factor(s) for s in range(5)] == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1])


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_skipped_step_does_not_shift_the_later_steps_rates(random_qwen3_path, zero_stage):
    """A NaN gradient at step 2 of a 5-step cosine: step 2 is skipped with the adapter unchanged, and steps 3-5 take
    lr_factor(2..4) (before, the skipped step did not advance DeepSpeed's scheduler, so step 3 took step 2's rate and
    the run never reached its floor)."""
    overrides = [*SCHEDULE, f"learner.zero_stage={zero_stage}"]
    learner = _learner(random_qwen3_path, overrides, Faults(frozenset({2})))
    factor, lr = lr_factor(learner.config), learner.config.learner.lr
    seen = _record_updates(learner)
    for step in range(1, 6):
        before, applied = _lora(learner), len(seen)
        sums = learner.step(_plan(step))
        want = lr * factor(step - 1)
        assert sums["lr"] == pytest.approx(want, rel=1e-12), step
        assert [r for r, _ in seen[applied:]] == pytest.approx([want] * (len(seen) - applied), rel=1e-12), step
        assert sums["skipped"] == (step == 2), step
        assert torch.equal(_lora(learner), before) == (step == 2), step
    assert learner.engine.get_lr()[0] == pytest.approx(lr * 0.1, rel=1e-12)  # the floor, at the last step
