"""The learner on multi-turn episodes: a response is an episode's tail (actions and observations interleaved) with a
loss mask (GroupBatch.loss_masks), so observation tokens are replayed as context and carry no loss.

- Observation tokens get exactly zero loss weight and are not counted by the aggregation or the trust mask (their
  rollout logprob is NaN: an engine never sampled them); the step's gradient equals the masked loss written by hand.
- LongStraw exact equals the padded full-sequence step on the same episodes, for a GQA, a hybrid and an MLA family.
- R3 replays the recorded routes on observation positions too: changing only those routes changes the logprobs of
  the sampled tokens after them, identically in both inner steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch
from conftest import build_random_tiny
from test_episodes import Builder, Echo
from test_inner_step import _lora_grads, real_learner
from transformers import AutoTokenizer

from mint.envs import EpisodeLimits, StopCondition, run_group
from mint.models.specs import load_model
from mint.models.tiny import ensure_tiny
from mint.rl.grpo import per_token_objective
from mint.rl.tasks import Example
from mint.rollout.engine import RolloutEngine
from mint.rollout.episodes import EnginePolicy, group_rollout
from mint.train.inner_step import GroupBatch, MicroStep, StepPlan, _score_padded, longstraw_group_step, naive_group_step
from mint.train.rollout_actor import GroupResult
from mint.train.step import to_batches

# Two episodes' tails after a 5-token prompt: 1 = sampled (an action), 0 = observation.
KINDS = [[1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 1]]


def _episodes(vocab: int, with_routes: bool, experts: int = 4, layers: int = 2) -> GroupBatch:
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, vocab, (5,), generator=gen)
    tails = [torch.randint(0, vocab, (len(k),), generator=gen) for k in KINDS]
    masks = [torch.tensor(k, dtype=torch.bool) for k in KINDS]
    # what an engine records: a logprob on sampled tokens, NaN on observation tokens (mint.envs.episode)
    # (about a random tiny's -log 97 = -4.6, so IcePop keeps them, except one whose ratio is far out of band)
    logprobs = [torch.where(m, torch.full((len(m),), -4.6), torch.tensor(math.nan)) for m in masks]
    logprobs[0][1] = -1.0
    routes = prompt_routes = None
    if with_routes:

        def rows(n):
            return torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(n * layers)]).view(
                n, layers, 2
            )

        prompt_routes = rows(4).to(torch.uint8)
        routes = [rows(len(t)).to(torch.uint8) for t in tails]
    return GroupBatch(prompt, tails, logprobs, torch.tensor([1.0, -0.5]), prompt_routes, routes, loss_masks=masks)


def _plan(group: GroupBatch) -> tuple[MicroStep, StepPlan]:
    plan = StepPlan([MicroStep(group, True)], total_tokens=sum(group.loss_lengths), total_seqs=len(group.responses))
    return plan.micro_steps[0], plan


def test_observation_tokens_carry_no_loss_and_are_not_counted(random_qwen3_path):
    learner = real_learner(random_qwen3_path, ["grpo.icepop=true"])
    group = _episodes(97, with_routes=True)
    micro, plan = _plan(group)
    assert plan.total_tokens == 5 + 4
    stats, _ = naive_group_step(learner.ctx, micro, plan, None, last=True)
    # the trust mask saw the 9 sampled tokens only: the NaN logprobs of the 5 observation tokens are not "non_finite"
    assert stats["trust"].tokens == 9 and stats["trust"].masked["non_finite"] == 0 and stats["tokens"] == 9.0
    assert stats["trust"].masked["ratio_low"] == 1 and stats["trust"].kept == 8
    grads = _lora_grads(learner)
    assert float(grads.abs().sum()) > 0
    learner.engine.optimizer.zero_grad()

    # by hand: the same forward, the per-token objective on sampled tokens only, token-mean over the 9 of them
    logp, _ = _score_padded(learner.ctx, group, with_grad=True, routes=learner.ctx.group_routes(group))
    manual = 0.0
    for i, logp_R in enumerate(logp):
        sampled = group.loss_masks[i]
        rollout = group.rollout_logprobs[i][sampled]
        # IcePop is on: the kept tokens are those whose ratio to the rollout's logprob is in [0.5, 5]
        keep = ((logp_R.detach()[sampled] - rollout).exp() >= 0.5) & ((logp_R.detach()[sampled] - rollout).exp() <= 5.0)
        loss_S, _ = per_token_objective(
            logp_R[sampled], logp_R.detach()[sampled], group.adv_G[i].expand(int(sampled.sum())), learner.ctx.spec
        )
        manual = manual + torch.where(keep, loss_S, 0.0).sum() / 9
    learner.engine.backward(manual)
    torch.testing.assert_close(grads, _lora_grads(learner), atol=1e-7, rtol=0)
    assert stats["loss"] == pytest.approx(float(manual.detach()), abs=1e-7)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe", "deepseek_v3"])
def family_path(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, build_random_tiny(request.param, str(tmp_path_factory.mktemp(request.param)))


def test_longstraw_exact_equals_the_full_sequence_step_on_episodes(family_path):
    """GQA, hybrid (Gated DeltaNet state carried through the observations) and MLA: same episodes, same masked
    objective; LongStraw exact's gradient and logprobs equal the padded full-sequence step's."""
    family, path = family_path
    # R3 off: these random bases have their own expert counts, and route replay on episodes has its own test below
    overrides = [
        "longstraw.mode=exact",
        "longstraw.chunk_size=2",
        "grpo.kl_coef=0.05",
        "grpo.icepop=false",
        "grpo.r3=false",
    ]
    learner = real_learner(path, overrides)
    micro, plan = _plan(_episodes(97, with_routes=False))
    naive_stats, naive_logp = naive_group_step(learner.ctx, micro, plan, None, last=True)
    naive = _lora_grads(learner)
    learner.engine.optimizer.zero_grad()
    ls_stats, ls_logp = longstraw_group_step(learner.ctx, micro, plan, None, last=True)
    assert float(naive.abs().sum()) > 0, family
    torch.testing.assert_close(_lora_grads(learner), naive, atol=1e-6, rtol=1e-4)
    for a, b in zip(ls_logp, naive_logp, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert ls_stats["loss"] == pytest.approx(naive_stats["loss"], abs=1e-6)
    assert ls_stats["trust"].tokens == naive_stats["trust"].tokens == 9


def test_r3_replays_the_recorded_routes_on_observation_positions(random_qwen3_path):
    """Rotating the recorded experts at observation positions only moves the logprobs of the sampled tokens after
    them (the routes were replayed there), and both inner steps agree on the new values."""
    learner = real_learner(random_qwen3_path, ["grpo.icepop=false", "longstraw.mode=exact"])
    group = _episodes(97, with_routes=True)
    rotated = [r.clone() for r in group.routes]
    for r, kinds in zip(rotated, KINDS, strict=True):
        # route row j is the forward that produced token j, whose input is token j-1: an observation token's
        # position is the row after it
        for j in range(1, len(kinds)):
            if kinds[j - 1] == 0:
                r[j] = (r[j].long() + 1).remainder(4).to(r.dtype)
    moved = dataclasses.replace(group, routes=rotated)

    def logp(inner_step, g):
        micro, plan = _plan(g)
        learner.engine.optimizer.zero_grad()
        _, out = inner_step(learner.ctx, micro, plan, None, last=True)
        return out

    base, after = logp(naive_group_step, group), logp(naive_group_step, moved)
    for i, kinds in enumerate(KINDS):
        # unchanged up to the first rotated row; changed at the rows that were rotated
        first = next(j for j in range(1, len(kinds)) if kinds[j - 1] == 0)
        torch.testing.assert_close(after[i][:first], base[i][:first], atol=1e-6, rtol=0)
        assert (after[i][first:] - base[i][first:]).abs().max() > 1e-4
    for a, b in zip(logp(longstraw_group_step, moved), after, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_engine_episodes_train_the_same_in_both_inner_steps_with_their_routes_replayed():
    """Episodes sampled by the built-in engine on an MoE base (mint.rollout.episodes), two of whose initial
    observations differ at the end, become one GroupBatch (group_rollout, to_batches): the shared part is the prompt,
    the rest of each initial observation opens its tail with no loss. Every position has its route, and LongStraw exact
    equals the full-sequence step."""
    path = ensure_tiny("qwen3_moe")
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = EnginePolicy(RolloutEngine(load_model(path), eos_token_ids=[]), revision="r", seed=5)
    stop = StopCondition(stop_tokens=(), max_tokens=3)
    prompts = [tokenizer(text)["input_ids"] for text in ("Q: 2 + 2 = ", "Q: 2 + 2 = ", "Q: 2 + 2 = ?", "Q: 2 + 2 = ?!")]
    envs = [
        Echo(p, tokenizer(" ok.")["input_ids"], 2, stop, mask_turn=1 if i == 3 else None) for i, p in enumerate(prompts)
    ]
    episodes = asyncio.run(run_group(Builder(envs), policy, EpisodeLimits(), key="g"))
    # the trainer's own path: the rollout actor's GroupResult, then the learner's batch
    result = GroupResult(Example("q", "4"), group_rollout(episodes), [], [ep.reward for ep in episodes], 0, "r")
    (group,) = to_batches([result], torch.tensor([[1.0, -1.0, 0.5, -0.5]]))
    assert group.prompt_tokens_P.tolist() == prompts[0]
    extra = [len(p) - len(prompts[0]) for p in prompts]
    for i, ep in enumerate(episodes):
        assert group.responses[i].tolist() == prompts[i][len(prompts[0]) :] + ep.tokens
        assert group.loss_masks[i].tolist() == [False] * extra[i] + [bool(m) for m in ep.loss_mask]
    sampled = sum(group.loss_lengths)
    assert sampled == 2 * 3 * 4 - 3  # episode 3's first action was masked

    learner = real_learner(path, ["grpo.icepop=false", "longstraw.mode=exact", "longstraw.chunk_size=3"])
    micro, plan = _plan(group)
    naive_stats, naive_logp = naive_group_step(learner.ctx, micro, plan, None, last=True)
    naive = _lora_grads(learner)
    learner.engine.optimizer.zero_grad()
    ls_stats, ls_logp = longstraw_group_step(learner.ctx, micro, plan, None, last=True)
    assert naive_stats["trust"].tokens == sampled and naive_stats["trust"].kept == sampled  # every route was there
    assert ls_stats["loss"] == pytest.approx(naive_stats["loss"], abs=1e-6)
    assert float(naive.abs().sum()) > 0
    torch.testing.assert_close(_lora_grads(learner), naive, atol=1e-6, rtol=1e-4)
    for a, b in zip(ls_logp, naive_logp, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_the_plan_balances_ranks_by_what_they_replay_and_counts_only_sampled_tokens():
    """plan_step: a rank's load is the tokens it replays (episode tails whole), the aggregation's total the tokens
    that carry loss. Group A replays 14 tokens of which 9 carry loss; B 9, all sampled; C 6, all sampled."""
    from mint.train.step import plan_step

    episodes = _episodes(97, with_routes=False)
    plain = [
        GroupBatch(
            episodes.prompt_tokens_P,
            [torch.arange(n) for n in lengths],
            [torch.zeros(n) for n in lengths],
            torch.zeros(len(lengths)),
        )
        for lengths in ([4, 5], [3, 3])
    ]
    plans = plan_step([episodes, *plain], world_size=2)
    assert {p.total_tokens for p in plans} == {9 + 9 + 6} and {p.total_seqs for p in plans} == {6}
    # A (14 replayed) alone on one rank, B (9) and C (6) on the other: by loss tokens A (9) would have tied B
    assert [[sum(m.group.lengths) for m in p.micro_steps if m.real] for p in plans] == [[14], [9, 6]]
