"""The expert-parallel learner against the single-rank learner, both built by `LearnerActor.setup` on real
DeepSpeed (ZeRO-1, gloo, fp32): EP=2 on 2 ranks (each rank holds 2 of the 4 experts), for both Qwen families.

The two ranks run different groups: different prompt lengths (so different capture and prompt-backward chunk counts),
different response counts G, and responses on either side of the checkpoint threshold, which is what the lockstep
(docs/sharding.md, "Lockstep") has to even out. The single-rank learner runs both groups; after DeepSpeed's boundary
reduction every LoRA gradient (the experts' gathered from their owners) must equal its gradient, and each group's
logprobs its logprobs, within 1e-5.

Context parallel (`longstraw.context_parallel`, at the end): CP=2 on 2 ranks and EP=2 x CP=2 on 4 ranks against the
single-rank learner the same way, the config's one-line refusals, and a short smoke run that learns.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import finish_rank, run_rank_processes

from longstraw.adapters import adapter_for
from mint.config import build_config
from mint.train.inner_step import GroupBatch, MicroStep, StepPlan, longstraw_group_step, naive_group_step

ATOL = RTOL = 1e-5
# (mode, chunk_size, checkpoint_min_tokens, batched): exact with unequal chunk counts and per-replay checkpoint
# agreement; exact with every prompt chunk checkpointed on one rank's account (the padding rank's empty passes then
# checkpoint too); exact with replay micro-batches of up to two rows (ranks with other lengths plan them over agreed
# lengths, longstraw.expert_parallel.LockstepAdapter.plan_lengths); detached.
SCENARIOS = {
    "naive": None,
    "exact": ("exact", 2, 3, False),
    "exact_checkpointed_chunks": ("exact", 4, 3, False),
    "exact_batched": ("exact", 2, 0, True),
    "detached": ("detached", 2, 3, False),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_learners(tmp_path, world: int, fn, *args, timeout: float = 300.0) -> list:
    """fn(rank, world, port, *args) on `world` fresh processes; each sets up its own LearnerActor (which joins the
    torch.distributed group through DeepSpeed). Returns the results in rank order; a rank's traceback fails the test."""
    # forkserver: children fork from a clean server that imported the heavy modules once, not from pytest's process,
    # where an earlier test (test_inner_step) may have left a torch.distributed group that a plain fork would inherit.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "deepspeed", "mint.train.learner", "test_sharded_learner"])
    run_dir = tmp_path / f"learners_{fn.__name__}_{world}_{len(list(tmp_path.iterdir()))}"
    run_dir.mkdir()
    return run_rank_processes(ctx, run_dir, world, _main, (world, _free_port(), fn, args), timeout)


def _main(run_dir: str, rank: int, world: int, port: int, fn, args) -> None:
    finish_rank(run_dir, rank, lambda: fn(rank, world, port, *args))


# ---- data ------------------------------------------------------------------------------------------------------------


def _group(seed: int, prompt_len: int, lengths: list[int], layers: int, experts: list[int]) -> GroupBatch:
    """A group whose recorded routes (R3) use only `experts`."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 90, (prompt_len,), generator=gen)
    responses = [torch.randint(3, 90, (n,), generator=gen) for n in lengths]
    pool = torch.tensor(experts)

    def routes(n: int) -> torch.Tensor:
        return torch.stack([pool[torch.randperm(len(pool), generator=gen)[:2]] for _ in range(n * layers)]).view(
            n, layers, 2
        )

    return GroupBatch(
        prompt,
        responses,
        [torch.full((n,), -2.0) for n in lengths],
        torch.randn(len(lengths), generator=gen),
        routes(prompt_len - 1).to(torch.uint8),
        [routes(n).to(torch.uint8) for n in lengths],
    )


def _groups(experts: list[int], n: int = 2) -> list[GroupBatch]:
    """One group per rank: rank 0's (P 7, G 3) and rank 1's (P 3, G 2) have unequal chunks, responses and lengths;
    ranks 2 and 3 (the second EP group on 4 ranks) another pair."""
    shapes = [(7, [4, 1, 2]), (3, [1, 5]), (5, [3, 3]), (4, [2, 6, 1])]
    return [_group(1 + i, p, lengths, 2, experts) for i, (p, lengths) in enumerate(shapes[:n])]


def _as_episodes(group: GroupBatch) -> GroupBatch:
    """The group's responses as episode tails: every third token from the second on is an observation token (no
    loss, NaN rollout logprob), the rest sampled (mint.rollout.episodes)."""
    masks = [torch.arange(len(r)) % 3 != 1 for r in group.responses]
    nan = torch.tensor(float("nan"))
    logprobs = [torch.where(m, lp, nan) for m, lp in zip(masks, group.rollout_logprobs, strict=True)]
    return dataclasses.replace(group, rollout_logprobs=logprobs, loss_masks=masks)


def _adapter_bytes(path: str) -> bytes:
    """A trained-looking adapter (PEFT's seeded A, a non-zero B: B = 0 would hide a wrong B mapping), as
    `lora.init` bytes, so every learner starts from it (the EP ranks through `load_full_lora_state`)."""
    from mint.config import LoraConfig
    from mint.hub import to_bytes
    from mint.models.lora import add_lora, lora_state
    from mint.models.specs import load_model

    state = lora_state(add_lora(load_model(path), LoraConfig(), seed=0))
    gen = torch.Generator().manual_seed(3)
    return to_bytes({k: torch.randn(v.shape, generator=gen) * 0.05 if "lora_B" in k else v for k, v in state.items()})


# ---- one learner rank ------------------------------------------------------------------------------------------------


def _config(ep: int, world: int):
    overrides = [
        f"learner.num_ranks={world}",
        f"learner.expert_parallel={ep}",
        "ray.torch_threads=1",
        "grpo.kl_coef=0.05",
        "grpo.icepop=false",
        "grpo.r3=true",
        "learner.grad_clip=0.5",  # below the test batches' norms (0.97 to 1.63), so the clip acts
    ]
    return build_config({}, overrides)


def _with_longstraw(config, model, mode: str, chunk: int, threshold: int, batched: bool):
    """config with LongStraw's `mode`, chunking and checkpoint threshold; `batched`: a replay budget that takes two
    rows of 6 tokens (the groups' longest) but not three of 5, so groups of three split into 2 + 1."""
    budget_mb = adapter_for(model).replay_graph_bytes(2, 6) / 2**20 if batched else 0.0
    ls = dataclasses.replace(
        config.longstraw, mode=mode, chunk_size=chunk, checkpoint_min_tokens=threshold, replay_budget_mb=budget_mb
    )
    return dataclasses.replace(config, longstraw=ls)


def _gradients(learner) -> dict[str, torch.Tensor]:
    """Every LoRA gradient after DeepSpeed's reduction, experts gathered from their owners (on rank 0), under the
    adapter's saved names. Collective: every rank calls it."""
    from deepspeed.utils import safe_get_full_grad

    from mint.models.expert_parallel import gather_expert_lora

    model = learner.engine.module
    params = [p for p in model.parameters() if p.requires_grad]
    full = [safe_get_full_grad(p) for p in params]  # one collective per parameter, in the same order everywhere
    for p, g in zip(params, full, strict=True):
        p.grad = g.to(p.dtype)
    grads = gather_expert_lora(model, learner.ep_group, grads=True)
    learner.engine.optimizer.zero_grad(set_to_none=True)
    for p in params:
        p.grad = None
    return grads


def _learner_rank(rank, world, port, path, ep, init, assigned, observe):
    """Set up a learner rank, then for each scenario run its groups, reduce, and return (grads, logprobs)."""
    import mint.models.expert_parallel as ep_module
    from mint.train.learner import LearnerActor

    rows = {"calls": 0, "per_expert": None}
    if observe:  # count the rows each local expert runs (an observer around the real function)
        original = ep_module.local_experts

        def counting(experts, gate_up, down, adapter, x, offsets, ends):
            counts = torch.tensor(ends).diff()
            rows["per_expert"] = counts if rows["per_expert"] is None else rows["per_expert"] + counts
            rows["calls"] += 1
            return original(experts, gate_up, down, adapter, x, offsets, ends)

        ep_module.local_experts = counting

    base = _config(ep, world)
    learner = LearnerActor(base, path, rank, world)
    learner.setup("127.0.0.1", port, init)
    groups = assigned[rank]
    total_tokens = sum(sum(g.lengths) for a in assigned for g in a)
    total_seqs = sum(len(g.responses) for a in assigned for g in a)
    plan = StepPlan([MicroStep(g, True) for g in groups], total_tokens, total_seqs)
    out = {}
    for name, scenario in SCENARIOS.items():
        learner.ctx.config = base if scenario is None else _with_longstraw(base, learner.engine.module, *scenario)
        step = naive_group_step if scenario is None else longstraw_group_step
        logps = []
        for i, micro in enumerate(plan.micro_steps):
            _, logp = step(learner.ctx, micro, plan, None, last=i == len(plan.micro_steps) - 1)
            logps.append([lp.detach() for lp in logp])
        learner.ctx.end_accumulation()
        out[name] = {"grads": _gradients(learner), "logp": logps}
    out["rows"] = rows
    # One whole optimizer step (the recipe's engine: LongStraw exact), clipped by the global norm (grad_clip 0.5).
    learner.ctx.config = base
    out["grad_norm"] = learner.step(plan)["grad_norm"]
    out["state"] = learner._full_lora_state()
    return out


# Every multi-rank learner run below is slow (10-35 s each on 2 shared cores: real DeepSpeed ranks on gloo, each
# building the tiny model); test-fast keeps the 2-rank parity of the sharded layers themselves in
# tests/test_expert_parallel.py and tests/test_context_parallel.py, and this file's one-line config refusals.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "world"), [("qwen3_moe", 2), ("qwen2_moe", 2), ("qwen3_moe", 4), ("glm_moe_dsa", 2)]
)
def test_ep2_learner_equals_the_single_rank_learner(tmp_path, family, world):
    """EP=2 on 2 ranks (and on 4: two EP groups that are data-parallel replicas, so the expert gradients reduce over
    the replicas and their optimizer state is split between them) against 1 rank running every group: naive, exact
    (two chunkings) and detached steps, then one clipped optimizer step. GLM-5 with index_topk 4: every group runs
    past it, so LongStraw's DSA selection and sparse attention run under the EP lockstep."""
    from conftest import build_random_tiny

    if family == "glm_moe_dsa":
        from test_dsa import _path

        path = _path(family, str(tmp_path / family), index_topk=4)
    else:
        path = build_random_tiny(family, str(tmp_path / family))
    init = _adapter_bytes(path)
    groups = _groups(experts=[0, 1, 2, 3], n=world)
    ep_results = run_learners(tmp_path, world, _learner_rank, path, 2, init, [[g] for g in groups], False)
    (single,) = run_learners(tmp_path, 1, _learner_rank, path, 1, init, [groups], False)
    for name in SCENARIOS:
        want, got = single[name]["grads"], ep_results[0][name]["grads"]
        assert got.keys() == want.keys() and any("mlp.experts" in k for k in want), name
        for key, g in want.items():
            assert g.abs().sum() > 0, (name, key)
            torch.testing.assert_close(got[key], g, atol=ATOL, rtol=RTOL, msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
        assert all(r[name]["grads"] == {} for r in ep_results[1:2])  # gathered on the EP group's first rank
        for rank in range(world):  # rank r ran group r; the single rank ran them all, in order
            for a, b in zip(ep_results[rank][name]["logp"][0], single[name]["logp"][rank], strict=True):
                torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    # The clipping norm counts every expert once (above the clip, so it acted), and the step moved the same weights.
    assert single["grad_norm"] > 0.5, single["grad_norm"]
    assert all(r["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5) for r in ep_results)
    assert ep_results[0]["state"].keys() == single["state"].keys() and ep_results[1]["state"] == {}
    # Adam's first step is lr·g/(|g| + 1e-8): an element whose gradient is ~1e-8 moves by a fraction of lr that
    # gradient noise of 1e-9 shifts by ~1e-5 (measured: 1.4e-5 on one of 512 elements, 4 ranks); 1% of lr bounds it.
    lr = _config(1, 1).learner.lr
    for key, value in single["state"].items():
        torch.testing.assert_close(ep_results[0]["state"][key], value, atol=0.01 * lr, rtol=0)
    print(f"grad_norm {single['grad_norm']:.4f}")


@pytest.mark.slow
def test_r3_replay_runs_no_token_on_unrecorded_experts(tmp_path):
    """Routes recorded on experts 0 and 1 only (rank 0's): under R3 the LongStraw steps send rank 1's experts no row
    at all, while rank 1 still takes part in every MoE call (its group's tokens go to rank 0). The naive step and the
    batched replays are left out: their right-padding positions have no recorded route and route natively (they are
    discarded)."""
    from conftest import build_random_tiny

    path = build_random_tiny("qwen3_moe", str(tmp_path / "qwen3"))
    groups = _groups(experts=[0, 1])
    only_longstraw = {k: v for k, v in SCENARIOS.items() if v is not None and not v[3]}
    results = run_learners(
        tmp_path, 2, _r3_rank, path, _adapter_bytes(path), [[groups[0]], [groups[1]]], only_longstraw
    )
    per_expert = [r["rows"]["per_expert"] for r in results]
    assert results[0]["rows"]["calls"] == results[1]["rows"]["calls"] > 0  # in step, call for call
    assert int(per_expert[1].sum()) == 0 and bool((per_expert[0] > 0).all()), per_expert


def _r3_rank(rank, world, port, path, init, assigned, scenarios):
    global SCENARIOS
    SCENARIOS = scenarios  # the forked child's copy only
    return _learner_rank(rank, world, port, path, 2, init, assigned, True)


def _resume_rank(rank, world, port, path, init, assigned, directory, revision):
    """Without `directory`'s checkpoint: step, checkpoint, step. With it: restore, step. Returns the adapter hash
    after the checkpointed step (rank 0), and the adapter after the last step."""
    from mint.hub import revision_id
    from mint.train.learner import LearnerActor

    learner = LearnerActor(_config(2, world), path, rank, world)
    learner.setup("127.0.0.1", port, init)
    groups = assigned[rank]
    total_tokens = sum(sum(g.lengths) for a in assigned for g in a)
    plan = StepPlan(
        [MicroStep(g, True) for g in groups], total_tokens, sum(len(g.responses) for a in assigned for g in a)
    )
    saved = None
    if revision is None:
        learner.step(plan)
        os.makedirs(f"{directory}/rng", exist_ok=True)
        learner.save_checkpoint(directory)
        state = learner._full_lora_state()
        saved = revision_id(state) if state else None
    else:
        assert learner.load_checkpoint(directory, revision) == revision
    learner.step(plan)
    return {"revision": saved, "state": learner._full_lora_state()}


@pytest.mark.slow
def test_ep2_checkpoint_resumes_where_the_run_left_off(tmp_path):
    """A restored EP learner's next step equals the uninterrupted one's. (DeepSpeed's model-state file holds rank 0's
    expert LoRA only; loading it gave rank 1 rank 0's experts until `_weights_from_master`.)"""
    from conftest import build_random_tiny

    path = build_random_tiny("qwen3_moe", str(tmp_path / "qwen3"))
    init, groups = _adapter_bytes(path), _groups(experts=[0, 1, 2, 3])
    assigned, directory = [[groups[0]], [groups[1]]], str(tmp_path / "checkpoint")
    first = run_learners(tmp_path, 2, _resume_rank, path, init, assigned, directory, None)
    revision = first[0]["revision"]
    resumed = run_learners(tmp_path, 2, _resume_rank, path, init, assigned, directory, revision)
    assert revision and resumed[0]["state"].keys() == first[0]["state"].keys()
    for key, value in first[0]["state"].items():
        assert torch.equal(resumed[0]["state"][key], value), key


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["learner.num_ranks=2", "learner.expert_parallel=3"], "does not divide learner.num_ranks = 2"),
        (["learner.num_ranks=4", "learner.expert_parallel=2", "learner.zero_stage=0"], "needs learner.zero_stage = 1"),
    ],
)
def test_expert_parallel_config_is_refused_in_one_line(overrides, message):
    from mint.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as err:
        build_config({}, overrides)
    assert "\n" not in str(err.value) and str(err.value).startswith("learner.expert_parallel:")


# ---- context parallel (longstraw.context_parallel) ---------------------------------------------------------------

# Context parallel is LongStraw's only, and replays one response at a time (no batched scenario).
CP_SCENARIOS = {k: v for k, v in SCENARIOS.items() if v is not None and not v[3]}


def _cp_rank(rank, world, port, path, ep, cp, init, groups):
    """A learner rank with EP = ep and CP = cp: its plan from `plan_step` (CP peers get the same groups), each
    LongStraw scenario's reduced gradients (on rank 0) and logprobs by prompt, then one clipped optimizer step."""
    from mint.train.learner import LearnerActor
    from mint.train.step import plan_step

    overrides = [f"learner.num_ranks={world}", f"learner.expert_parallel={ep}", f"longstraw.context_parallel={cp}"]
    overrides += ["ray.torch_threads=1", "grpo.kl_coef=0.05", "grpo.icepop=false", "grpo.r3=true"]
    base = build_config({}, [*overrides, "learner.grad_clip=0.5", "learner.inner_step=longstraw"])
    learner = LearnerActor(base, path, rank, world)
    learner.setup("127.0.0.1", port, init)
    plan = plan_step(groups, world, 0, cp, ep)[rank]
    out = {"prompts": [bytes(m.group.prompt_tokens_P.numpy()) for m in plan.micro_steps]}
    for name, scenario in CP_SCENARIOS.items():
        learner.ctx.config = _with_longstraw(base, learner.engine.module, *scenario)
        logps = {}
        for i, micro in enumerate(plan.micro_steps):
            _, logp = longstraw_group_step(learner.ctx, micro, plan, None, last=i == len(plan.micro_steps) - 1)
            logps[bytes(micro.group.prompt_tokens_P.numpy())] = [lp.detach() for lp in logp]
        learner.ctx.end_accumulation()
        out[name] = {"grads": _gradients(learner), "logp": logps}
    learner.ctx.config = base
    out["grad_norm"] = learner.step(plan)["grad_norm"]
    out["state"] = learner._full_lora_state()
    return out


def _check_cp_against_single(sharded: list, single: dict, world: int, cp: int) -> None:
    for name in CP_SCENARIOS:
        want, got = single[name]["grads"], sharded[0][name]["grads"]
        assert got.keys() == want.keys() and want, name
        for key, g in want.items():
            assert g.abs().sum() > 0, (name, key)
            torch.testing.assert_close(got[key], g, atol=ATOL, rtol=RTOL, msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
        for rank in range(world):  # every rank scored its groups exactly as the single rank did
            for prompt, logp in sharded[rank][name]["logp"].items():
                for a, b in zip(logp, single[name]["logp"][prompt], strict=True):
                    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    d = world // cp
    for rank in range(world):  # the CP peers of a rank ran the same groups; the replicas together ran all of them
        assert sharded[rank]["prompts"] == sharded[rank % d]["prompts"]
    assert sorted(p for r in sharded[:d] for p in r["prompts"]) == sorted(single["prompts"])
    assert single["grad_norm"] > 0.5, single["grad_norm"]
    assert all(r["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5) for r in sharded)
    lr = build_config({}, []).learner.lr
    for key, value in single["state"].items():
        torch.testing.assert_close(sharded[0]["state"][key], value, atol=0.01 * lr, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_cp2_learner_equals_the_single_rank_learner(tmp_path, family):
    """CP=2 on 2 ranks (one replica: both ranks run both groups, each keeping half of every prompt's pages) against 1
    rank: exact (two chunkings) and detached LoRA gradients and logprobs within 1e-5, then one clipped step."""
    from conftest import build_random_tiny

    path = build_random_tiny(family, str(tmp_path / family))
    init = _adapter_bytes(path)
    groups = _groups(experts=[0, 1, 2, 3], n=2)
    sharded = run_learners(tmp_path, 2, _cp_rank, path, 1, 2, init, groups)
    (single,) = run_learners(tmp_path, 1, _cp_rank, path, 1, 1, init, groups)
    _check_cp_against_single(sharded, single, world=2, cp=2)
    assert all(r[name]["grads"] == {} for r in sharded[1:] for name in CP_SCENARIOS)  # gathered on rank 0


@pytest.mark.slow
def test_ep2_cp2_learner_on_4_ranks_equals_the_single_rank_learner(tmp_path):
    """EP=2 x CP=2 on 4 ranks: EP groups {0, 1}, {2, 3} and CP groups {0, 2}, {1, 3}, so two replicas (ranks 0 and 2
    run group A, 1 and 3 group B), each EP group holding both. Against 1 rank running both groups. The groups are
    multi-turn episodes (masked tails), so the sharded steps' lockstep stand-ins and CP pages carry the loss mask."""
    from conftest import build_random_tiny

    path = build_random_tiny("qwen3_moe", str(tmp_path / "qwen3_moe"))
    init = _adapter_bytes(path)
    groups = [_as_episodes(g) for g in _groups(experts=[0, 1, 2, 3], n=2)]
    sharded = run_learners(tmp_path, 4, _cp_rank, path, 2, 2, init, groups)
    (single,) = run_learners(tmp_path, 1, _cp_rank, path, 1, 1, init, groups)
    _check_cp_against_single(sharded, single, world=4, cp=2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["learner.num_ranks=2", "longstraw.context_parallel=3"], "does not divide learner.num_ranks = 2"),
        (
            ["learner.num_ranks=4", "learner.expert_parallel=2", "longstraw.context_parallel=4"],
            "4 x learner.expert_parallel 2 = 8 does not divide",
        ),
        (
            ["learner.num_ranks=2", "longstraw.context_parallel=2", "learner.inner_step=naive"],
            "learner.inner_step = naive",
        ),
        (["learner.num_ranks=2", "longstraw.context_parallel=2", "longstraw.mode=resident"], "mode = resident"),
    ],
)
def test_context_parallel_config_is_refused_in_one_line(overrides, message):
    from mint.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as err:
        build_config({}, overrides)
    assert "\n" not in str(err.value) and str(err.value).startswith("longstraw.context_parallel:")


@pytest.mark.slow
def test_cp2_smoke_run_learns(tmp_path):
    """`mint train recipes/smoke.toml learner.num_ranks=2 learner.inner_step=longstraw longstraw.context_parallel=2`,
    cut to 30 steps (~2.2 s each on 2 cores): both ranks run every group, each holding half of each prompt's pages.
    The reward rises as the single-rank run's does (0.28 -> ~0.6 over the first 30 steps of the smoke recipe), and
    the rollout engine scores with exactly the learner's published adapter."""
    import json
    from pathlib import Path

    from mint.config import load_config
    from mint.train.driver import train

    root = Path(__file__).resolve().parents[1]
    overrides = ["learner.num_ranks=2", "learner.inner_step=longstraw", "longstraw.context_parallel=2", "grpo.steps=30"]
    overrides += [f"logging.root={tmp_path}", "logging.name=cp", "logging.progress=false"]
    summary = train(load_config(root / "recipes/smoke.toml", overrides))
    assert summary["reward_gain"] >= 0.2, summary
    lines = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 30 and all(m["logp_diff_max"] < 1e-4 for m in lines)
