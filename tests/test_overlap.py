"""Overlapped steps (rollout.max_staleness): rollout runs ahead of the learner by at most k revisions.

End to end through real local Ray and DeepSpeed (gloo) on the smoke recipe, one learner rank. One reference run at
k = 1 (24 steps, a checkpoint every 8) learns, and every step's samples come from the revision its staleness says
(the catalog's rollout records name it). Two drills end where the reference does: a driver resumed from a periodic
checkpoint, and a SIGKILLed rollout actor (real signal, restarted by Ray, its shard redone). k = 0 stays the on-policy
loop.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import headroom_closed, new_run_mark, run_mark_env, wait_for_processes

from mint.config import load_config
from mint.train.driver import train
from mint.train.pipeline import queue_limit

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 24, 8
K1 = [f"grpo.steps={STEPS}", "rollout.max_staleness=1", f"checkpoint.every={EVERY}"]
SMALL = ["learner.num_ranks=1", "ray.learner_cpus=1", "ray.rollout_cpus=1", "catalog.export_every=1000"]


def test_queue_limit_bounds_staleness_and_drains_at_checkpoints():
    # k = 0: only the step itself is ever in flight (the on-policy loop).
    assert [queue_limit(s, 0, 10, 4) for s in range(1, 11)] == list(range(1, 11))
    # k = 2, checkpoints every 4 steps: never past the next checkpoint step or the last step.
    assert [queue_limit(s, 2, 10, 4) for s in range(1, 11)] == [3, 4, 4, 4, 7, 8, 8, 8, 10, 10]
    # No periodic checkpoints: only the run's end bounds it.
    assert [queue_limit(s, 1, 5, 0) for s in range(1, 6)] == [2, 3, 4, 5, 5]


def test_checkpoint_every_joins_the_result_digest_only_with_overlap():
    """With k >= 1 the overlap drains at checkpoint steps, so checkpoint.every decides which revision samples a step:
    --resume must refuse a change. On-policy it changes nothing a step computes."""

    def digest(*overrides: str) -> str:
        return load_config(ROOT / "recipes/smoke.toml", list(overrides)).result_digest()

    assert digest("checkpoint.every=8") == digest("checkpoint.every=5")
    assert digest("rollout.max_staleness=1", "checkpoint.every=8") != digest(
        "rollout.max_staleness=1", "checkpoint.every=5"
    )
    assert digest("rollout.max_staleness=1", "checkpoint.keep_last=3") == digest("rollout.max_staleness=1")


def _config(root: Path, name: str, *overrides: str):
    extra = [f"logging.root={root}", f"logging.name={name}", "logging.progress=false", *SMALL, *overrides]
    return load_config(ROOT / "recipes/smoke.toml", extra)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _sampled_with(run: Path) -> dict[int, str]:
    """step -> the first 12 hex digits of the revision that sampled it, from the catalog's rollout record files."""
    out = {}
    for path in (run / "catalog" / "records" / run.name).glob("step_*.safetensors"):
        step, rev = path.name.split(".")[:2]
        out[int(step.removeprefix("step_"))] = rev
    return out


def _staleness(step: int) -> int:
    """At k = 1: 0 on the first step and on the first step after each checkpoint (the overlap drained), else 1."""
    return 0 if (step - 1) % EVERY == 0 else 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, list[dict]]:
    """The k = 1 run the drills must reproduce: its summary and metrics rows."""
    summary = train(_config(tmp_path_factory.mktemp("overlap"), "k1", *K1))
    return summary, _metrics(Path(summary["run_dir"]))


@pytest.mark.slow
def test_max_staleness_1_learns_from_samples_one_revision_old(reference):
    summary, lines = reference
    run = Path(summary["run_dir"])
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    expected = [_staleness(m["step"]) for m in lines]
    assert [m["staleness_max"] for m in lines] == expected
    assert [m["staleness_mean"] for m in lines] == [float(x) for x in expected]

    # The rollout records name the revision that sampled each step: the one published two steps back when stale,
    # the previous step's when drained (step 0's revision, the initial adapter, sampled step 1).
    sampled = _sampled_with(run)
    assert sorted(sampled) == list(range(1, STEPS + 1))
    revision = {0: sampled[1]} | {m["step"]: m["revision"][:12] for m in lines}
    for m, stale in zip(lines, expected, strict=True):
        assert sampled[m["step"]] == revision[m["step"] - 1 - stale], m["step"]

    # The samples really came from an older adapter: the learner's logprobs of them differ from the rollout's, while
    # a drained step is exact up to fp32 noise. IcePop keeps most tokens at this drift.
    for m, stale in zip(lines, expected, strict=True):
        assert (m["logp_diff_max"] > 1e-3) if stale else (m["logp_diff_max"] < 1e-4), m
        assert m["trust_kept_frac"] > 0.9, m

    # Time split: the learner's step plus its idle time is the step. A step the learners began while the loop was
    # still in the one before can count more learner seconds than loop seconds; its idle time is then 0, not negative.
    for m in lines:
        assert m["learn_s"] > 0 and m["sync_s"] > 0 and m["rollout_s"] >= 0
        assert m["idle_s"] >= 0
        assert m["idle_s"] == pytest.approx(max(m["step_s"] - m["learn_s"], 0.0))

    # It learns, against the headroom: this run went 0.29 -> 0.65 (first and last 8 steps), closing 0.50 of
    # 1 - first; the former bar, a gain of 0.1 from 0.29, was 0.14 of it.
    rewards = [m["reward_mean"] for m in lines]
    first, last = sum(rewards[:EVERY]) / EVERY, sum(rewards[-EVERY:]) / EVERY
    assert last >= 0.45 and headroom_closed(first, last) >= 0.25, (first, last)


@pytest.mark.slow
def test_max_staleness_1_resumed_from_a_checkpoint_ends_where_the_uninterrupted_run_does(tmp_path, reference):
    """A driver killed after the checkpoint at step 16: the overlap drained there, so the resumed run samples every
    later step with the same revision as the reference."""
    summary, lines = reference
    run = tmp_path / "k1"
    shutil.copytree(summary["run_dir"], run)
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS:06d}")
    resumed = train(_config(tmp_path, "k1", *K1), resume=True)
    again = _metrics(run)
    assert resumed["revision"] == summary["revision"]
    assert [m["revision"] for m in again] == [m["revision"] for m in lines]
    assert [m["staleness_max"] for m in again] == [_staleness(m["step"]) for m in lines]


@pytest.mark.slow
def test_max_staleness_1_survives_a_sigkilled_rollout_actor(tmp_path, reference):
    """The shard is redone with the revision its step was queued with: the run ends at the reference's revision
    (grpo.steps only bounds the queue at the end, so the reference's step 12 is this run's last step)."""
    _, lines = reference
    steps = 12
    cmd = [sys.executable, "-m", "mint.cli", "train", "recipes/smoke.toml", *K1, f"grpo.steps={steps}", *SMALL]
    cmd += [f"logging.root={tmp_path}", "logging.name=killed", "logging.progress=false"]
    # Marked, so the victim is this run's rollout actor and no other job's on the machine.
    mark = new_run_mark()
    env = {**os.environ, **run_mark_env(mark)}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    # Found while the run starts: a step takes a fraction of a second, so a search after step 2 could miss the run.
    victims = wait_for_processes(mark, "ray::RolloutActor", 1, timeout=300)
    assert victims, "no rollout actor of this run"
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.time() < deadline, "the run ended or stalled before step 2"
        time.sleep(0.02)
    os.kill(victims[0], signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    rows = _metrics(tmp_path / "killed")
    assert rows[-1]["rollout_restarts"] >= 1
    assert summary["revision"] == lines[steps - 1]["revision"]
    assert [m["staleness_max"] for m in rows] == [_staleness(m["step"]) for m in rows]


@pytest.mark.slow
def test_max_staleness_0_stays_on_policy(tmp_path):
    config = _config(tmp_path, "k0", "grpo.steps=3", "checkpoint.every=0")
    assert config.rollout.max_staleness == 0
    summary = train(config)
    run = Path(summary["run_dir"])
    sampled = _sampled_with(run)
    for prev, m in zip([None, *_metrics(run)], _metrics(run), strict=False):
        assert m["staleness_max"] == 0 and m["staleness_mean"] == 0.0
        # Sampled with exactly the revision the learner scores: logprobs equal up to fp32 noise.
        assert m["logp_diff_max"] < 1e-4, m
        if prev is not None:
            assert sampled[m["step"]] == prev["revision"][:12]
        # Nothing was in flight: the step waited for its whole rollout, then learned.
        assert m["step_s"] >= m["rollout_s"] + m["learn_s"]
