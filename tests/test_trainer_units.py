"""The driver's pure pieces: step planning across ranks, the run summary, the run directory, the catalog writer, and
the rules that stop a run that is not learning."""

import json
import threading

import pytest
import torch

from mint.config import build_config
from mint.errors import MintError
from mint.train.checkpoint import RunState
from mint.train.driver import prepare_run_dir, summarize
from mint.train.learner import GroupBatch
from mint.train.step import CatalogWriter, plan_step
from mint.train.stops import bad_steps_message, check_kept


def _group(lengths: list[int]) -> GroupBatch:
    return GroupBatch(
        prompt_tokens_P=torch.tensor([1, 2, 3]),
        responses=[torch.ones(n, dtype=torch.long) for n in lengths],
        rollout_logprobs=[torch.zeros(n) for n in lengths],
        adv_G=torch.zeros(len(lengths)),
    )


def test_plan_step_balances_tokens_and_pads_ranks_to_lockstep():
    groups = [_group([5, 5]), _group([1, 1]), _group([2, 2]), _group([4, 4]), _group([1, 2])]  # 10, 2, 4, 8, 3 tokens
    plans = plan_step(groups, world_size=2)
    assert len({len(p.micro_steps) for p in plans}) == 1, "ranks must run the same number of micro-steps"
    real = [[m.group for m in p.micro_steps if m.real] for p in plans]
    assert sorted(id(g) for r in real for g in r) == sorted(id(g) for g in groups), "each group exactly once"
    loads = [sum(len(r) for g in rank for r in g.responses) for rank in real]
    assert loads == [13, 14] or loads == [14, 13]  # greedy by size: 10+3 | 8+4+2
    assert all(p.total_tokens == 27 and p.total_seqs == 10 for p in plans)


def test_plan_step_gives_an_idle_rank_zero_weight_copies():
    plans = plan_step([_group([3, 3])], world_size=3)
    assert [len(p.micro_steps) for p in plans] == [1, 1, 1]
    assert sum(m.real for p in plans for m in p.micro_steps) == 1


def test_summary_uses_first_and_last_ten_percent():
    rewards = [0.0] * 5 + [0.5] * 40 + [1.0] * 5  # 50 steps: windows of 5
    s = summarize(rewards, "rev", 12.34)
    assert (s["reward_first"], s["reward_last"], s["reward_gain"]) == (0.0, 1.0, 1.0)
    assert s["steps"] == 50 and s["seconds"] == 12.3
    short = summarize([0.25, 0.75], "rev", 1.0)  # fewer than 10 steps: one-step windows
    assert (short["reward_first"], short["reward_last"]) == (0.25, 0.75)


def test_a_previous_run_is_moved_aside_not_mixed_in(tmp_path, capsys):
    config = build_config({}, [f"logging.root={tmp_path}", "logging.name=r"])
    first = prepare_run_dir(config)
    (first / "metrics.jsonl").write_text('{"step": 1}\n')
    second = prepare_run_dir(config)
    assert second == first and not (second / "metrics.jsonl").exists()
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("r.")]
    assert len(moved) == 1 and (moved[0] / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert json.loads((second / "config.json").read_text())["logging"]["name"] == "r"
    assert "moved the previous run" in capsys.readouterr().err


def test_context_parallel_groups_stay_inside_blocks_of_ep_times_cp_ranks():
    """CP groups are block-local (a block of EP x CP consecutive ranks is what placement keeps on one node), every
    rank serves exactly one replica, the CP peers share it, and with one block the layout is the strided one."""
    from mint.train.context_parallel import cp_group_ranks, replica_of

    assert cp_group_ranks(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert cp_group_ranks(4, 2, 2) == [[0, 2], [1, 3]] and cp_group_ranks(2, 2) == [[0, 1]]
    assert cp_group_ranks(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for world, cp, ep in [(8, 2, 2), (8, 4, 2), (16, 2, 4), (8, 8, 1)]:
        groups = cp_group_ranks(world, cp, ep)
        assert sorted(r for g in groups for r in g) == list(range(world)) and len(groups) == world // cp
        for d, ranks in enumerate(groups):
            assert {replica_of(r, cp, ep) for r in ranks} == {d}
            assert len({r // (cp * ep) for r in ranks}) == 1  # one block
    plans = plan_step([_group([3, 3]), _group([2]), _group([4])], world_size=8, context_parallel=2, expert_parallel=2)
    for ranks in cp_group_ranks(8, 2, 2):
        assert all(plans[r] is plans[ranks[0]] for r in ranks)


def test_the_catalog_writer_writes_in_order_off_the_callers_thread_and_raises_a_failed_write_later():
    release, order, threads = threading.Event(), [], set()

    def copy(n: int, seconds: float):
        def run() -> float:
            if n == 1:
                release.wait(10)  # the caller goes on while the first copy is still being written
            order.append(n)
            threads.add(threading.current_thread().name)
            return seconds

        return run

    writer = CatalogWriter()
    writer.submit(copy(1, 0.5))
    writer.submit(copy(2, 0.25))
    assert order == []  # submit did not wait
    release.set()
    writer.wait()
    assert order == [1, 2] and writer.seconds == 0.25
    assert threads and all(name.startswith("mint-catalog") for name in threads)

    def full_disk() -> float:
        raise MintError("catalog: no space left on device")

    writer.submit(full_disk)
    with pytest.raises(MintError, match="no space left"):
        writer.wait()
    writer.submit(full_disk)
    with pytest.raises(MintError, match="no space left"):  # at the latest by the next submit after it finished
        for _ in range(100):
            writer.submit(copy(3, 0.0))
            threading.Event().wait(0.01)
    writer.close()

    with pytest.raises(ValueError, match="the run's own error"), CatalogWriter() as w:  # that error wins on the way out
        w.submit(full_disk)
        raise ValueError("the run's own error")


def test_the_bad_steps_line_names_a_non_finite_loss_and_does_not_blame_learner_lr(tmp_path):
    """Three skipped steps whose loss was NaN (the learner's cause "loss") ended the run with "a non-finite gradient
    ... lower learner.lr" whatever broke, which sent users after the learning rate. The line now says which was
    not finite; a finite loss with a NaN gradient still points at learner.lr."""
    config = build_config({}, [])
    latest = tmp_path / "checkpoints" / "step_000004"
    loss = bad_steps_message(config, 3, "loss", latest)
    assert loss.startswith("3 consecutive steps had a non-finite loss") and "learner.lr" not in loss, loss
    assert str(latest) in loss and "model.dtype = float32" in loss and "\n" not in loss
    gradient = bad_steps_message(config, 3, "gradient", None)
    assert gradient.startswith("3 consecutive steps had a non-finite gradient with a finite loss"), gradient
    assert "lower learner.lr" in gradient and "the last good checkpoint is none" in gradient


def _trust_sums(kept: float, **dropped: float) -> dict:
    """The learner group's sums of a step with 100 response tokens (TrustCounts.metrics' keys)."""
    out = {"tokens": 100.0, "trust_kept_frac": kept}
    out.update(
        {f"trust_dropped_{c}": dropped.get(c, 0.0) for c in ("route_missing", "route_mismatch", "non_finite", "icepop")}
    )
    return out


def test_every_token_route_missing_for_patience_steps_stops_with_one_line_naming_route_missing():
    """Steps whose every response token was masked route_missing (an engine without routed experts, R3 on) had a zero
    gradient, were published as if fine, and the run ended with exit 0 having learned nothing. Two such steps with
    patience 2 now end the run with one line naming route_missing and its fix; the first only counts."""
    config = build_config({}, ["grpo.min_kept_patience=2"])
    state = RunState()
    check_kept(config, state, 1, _trust_sums(0.0, route_missing=1.0))
    assert state.low_kept_steps == 1
    with pytest.raises(MintError) as info:
        check_kept(config, state, 2, _trust_sums(0.0, route_missing=0.9, icepop=0.1))
    message = str(info.value)
    assert "\n" not in message and "dropped 90.0% as route_missing" in message, message
    assert "--enable-return-routed-experts" in message and "grpo.r3=false" in message, message
    assert message.startswith("2 consecutive steps kept less than grpo.min_kept_fraction = 0.2"), message


def test_kept_fraction_streak_resets_on_a_good_step_ignores_a_step_without_tokens_and_0_never_stops():
    config = build_config({}, ["grpo.min_kept_patience=2"])
    state = RunState()
    check_kept(config, state, 1, _trust_sums(0.1, icepop=0.9))
    check_kept(config, state, 2, {"tokens": 0.0})  # no group kept: nothing was scored, the streak stands
    assert state.low_kept_steps == 1
    check_kept(config, state, 3, _trust_sums(0.95, non_finite=0.05))
    assert state.low_kept_steps == 0
    with pytest.raises(MintError, match=r"dropped 60\.0% as non_finite; .*NaN or inf"):
        for step in (4, 5):
            check_kept(config, state, step, _trust_sums(0.1, non_finite=0.6, icepop=0.3))
    never = build_config({}, ["grpo.min_kept_fraction=0", "grpo.min_kept_patience=1"])
    check_kept(never, RunState(), 1, _trust_sums(0.0, route_missing=1.0))
