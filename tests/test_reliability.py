"""Runs that survive, through real local Ray and DeepSpeed on CPU, with real signals.

One uninterrupted reference run (10 steps, a checkpoint every 2) fixes the final revision. Every drill below ends at
that same revision, bit for bit: kill -9 of the driver then --resume, a SIGKILLed rollout actor (restarted by Ray,
its shard redone), a SIGKILLed learner rank (the actors restarted from the checkpoint), Ctrl-C then --resume.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import new_run_mark, processes_of_run, run_mark_env, wait_for_processes

from mint.config import load_config
from mint.train.driver import train

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
STEPS = 10
COMMON = [f"grpo.steps={STEPS}", "checkpoint.every=2", "learner.num_ranks=2", "logging.progress=false"]


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _cmd(root: Path, name: str, *extra: str) -> list[str]:
    base = [sys.executable, "-m", "mint.cli", "train", "recipes/smoke.toml", *COMMON]
    return [*base, f"logging.root={root}", f"logging.name={name}", *extra]


def _start(cmd: list[str], **env) -> subprocess.Popen:
    """`mint train` in its own session (so the drill can signal its whole process group, as a scheduler would)."""
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **env},
    )


def _wait_for_step(proc: subprocess.Popen, run: Path, step: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(m["step"] >= step for m in _metrics(run)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.communicate()[1][-3000:]}")
        time.sleep(0.02)  # a step of the smoke run takes about 0.1 s on 2 cores
    proc.kill()
    raise AssertionError(f"no step {step} within {timeout} s")


def _actors(proc: subprocess.Popen, mark: str, title: str, count: int) -> list[int]:
    """The run's `count` actor processes titled `title`, found while it starts. A drill finds its victims before the
    step it kills at: steps take about 0.1 s, so a search begun after the step can find the run already over."""
    pids = wait_for_processes(mark, title, count, timeout=300)
    assert len(pids) == count and proc.poll() is None, (title, pids, proc.poll())
    return pids


def _finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run every drill must reproduce."""
    root = tmp_path_factory.mktemp("reference")
    summary = train(load_config(ROOT / "recipes/smoke.toml", [*COMMON, f"logging.root={root}", "logging.name=ref"]))
    assert summary["steps"] == STEPS and not summary["interrupted"]
    return summary


def test_kill_9_of_the_driver_then_resume_is_bit_identical(tmp_path, reference):
    run = tmp_path / "killed"
    proc = _start(_cmd(tmp_path, "killed"))
    _wait_for_step(proc, run, 3)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything in its session, mid-run
    proc.wait()
    done = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "step_000002" in done, done

    code, out, err = _finish(_start(_cmd(tmp_path, "killed", "--resume")))
    assert code == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["revision"] == reference["revision"]
    assert [m["step"] for m in _metrics(run)] == list(range(1, STEPS + 1))  # appended, no step twice
    assert summary["reward_first"] == reference["reward_first"] and summary["steps"] == STEPS


def test_kill_9_mid_write_of_metrics_then_resume_logs_every_step_and_sample_once(tmp_path, reference):
    """The driver SIGKILLed halfway through writing step 5's metrics line (MINT_FAULTS=torn_metrics@5: a kill -9
    landing mid-write), after the checkpoint of step 4 and after step 5's samples were logged. --resume used to stop
    with a JSONDecodeError traceback on the torn line, and it never cut samples.jsonl back, so step 5's samples would
    have been logged twice. It now cuts every per-step log back to step 4 and ends at the uninterrupted revision."""
    run = tmp_path / "torn"
    logs = "logging.samples_every=1"
    mark = new_run_mark()
    code, _, err = _finish(_start(_cmd(tmp_path, "torn", logs), MINT_FAULTS="torn_metrics@5", **run_mark_env(mark)))
    assert code == -signal.SIGKILL, err[-3000:]
    for pid in processes_of_run(mark, "ray"):  # Ray's processes fate-share with the driver; any straggler goes now
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    torn = (run / "metrics.jsonl").read_text()
    assert not torn.endswith("\n") and [json.loads(line)["step"] for line in torn.splitlines()[:-1]] == [1, 2, 3, 4]
    assert 5 in {json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()}

    code, out, err = _finish(_start(_cmd(tmp_path, "torn", logs, "--resume")))
    assert code == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["revision"] == reference["revision"]
    assert [m["step"] for m in _metrics(run)] == list(range(1, STEPS + 1))
    sampled = Counter(json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines())
    assert sorted(sampled) == list(range(1, STEPS + 1)) and len(set(sampled.values())) == 1, sampled


def test_resume_refuses_a_recipe_that_computes_something_else(tmp_path, reference):
    ref_root = Path(reference["run_dir"]).parent
    cmd = [*_cmd(ref_root, "ref", "--resume"), "learner.lr=0.002"]
    ray_tmp = tmp_path / "ray-tmp"  # where a Ray started by this process would put its session directory
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--resume: the recipe differs" in lines[0], proc.stderr
    assert not ray_tmp.exists(), "refused only after starting Ray"


def test_a_sigkilled_rollout_actor_is_restarted_and_the_run_completes(tmp_path, reference):
    run = tmp_path / "rollout"
    mark = new_run_mark()
    proc = _start(_cmd(tmp_path, "rollout"), **run_mark_env(mark))
    victims = _actors(proc, mark, "ray::RolloutActor", 1)  # this run's, not another job's on the machine
    _wait_for_step(proc, run, 2)
    os.kill(victims[0], signal.SIGKILL)
    code, out, err = _finish(proc)
    assert code == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert _metrics(run)[-1]["rollout_restarts"] >= 1
    assert summary["revision"] == reference["revision"]  # the retried shard sampled the same tokens


def test_a_sigkilled_learner_rank_restarts_from_the_checkpoint(tmp_path, reference):
    run = tmp_path / "learner"
    mark = new_run_mark()
    proc = _start(_cmd(tmp_path, "learner"), **run_mark_env(mark))
    victims = _actors(proc, mark, "ray::LearnerActor", 2)
    _wait_for_step(proc, run, 3)
    os.kill(victims[1], signal.SIGKILL)
    code, out, err = _finish(proc)
    assert code == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["restarts"] == 1 and "restarting the actors from the checkpoint" in err
    assert summary["revision"] == reference["revision"]
    assert [m["step"] for m in _metrics(run)] == list(range(1, STEPS + 1))


def test_ctrl_c_checkpoints_writes_a_summary_and_exits_130(tmp_path, reference):
    """The interrupted run is asked for 40 steps (grpo.steps may change on resume), so Ctrl-C cannot race the end of
    the run; the resume then stops at the reference's STEPS."""
    run = tmp_path / "ctrlc"
    mark = new_run_mark()
    proc = _start([*_cmd(tmp_path, "ctrlc"), "grpo.steps=40"], **run_mark_env(mark))
    _wait_for_step(proc, run, 1)
    os.kill(proc.pid, signal.SIGINT)
    code, _, err = _finish(proc)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "mint: interrupted after step" in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and summary["checkpoint"].endswith(f"step_{summary['steps']:06d}")
    assert summary["steps"] < STEPS, "Ctrl-C was handled too late for the comparison below"
    # Ray's processes went with it
    assert not processes_of_run(mark, "ray::LearnerActor") and not processes_of_run(mark, "ray::RolloutActor")

    code, out, err = _finish(_start(_cmd(tmp_path, "ctrlc", "--resume")))
    assert code == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["revision"] == reference["revision"]


@pytest.mark.parametrize("zero_stage", [1, 0])
def test_a_non_finite_step_is_skipped_and_never_published(tmp_path, zero_stage):
    """MINT_FAULTS makes step 2's gradient NaN on every rank (mint.train.faults). ZeRO-1: DeepSpeed's optimizer skips
    it; ZeRO-0: the ranks agree on it and skip engine.step(). Either way nothing is published and the run goes on
    from the unchanged adapter."""
    cmd = _cmd(tmp_path, "nan", "grpo.steps=3", f"learner.zero_stage={zero_stage}")
    code, out, err = _finish(_start(cmd, MINT_FAULTS="nan_gradient@2"))
    assert code == 0, err[-3000:]
    lines = _metrics(tmp_path / "nan")
    assert [m["skipped"] for m in lines] == [0, 1, 0]
    assert lines[1]["revision"] == lines[0]["revision"] and lines[2]["revision"] != lines[1]["revision"]
    assert lines[1]["grad_norm"] is None  # inf, written as null
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["skipped_steps"] == 1
    from mint.hub import Catalog

    with Catalog(tmp_path / "nan" / "catalog", create=False) as store:
        assert sorted(m.step for m in store.list(run="nan")) == [0, 1, 3]  # step 2 published nothing


def test_consecutive_bad_steps_stop_the_run_with_one_line(tmp_path):
    faults = "nan_gradient@1,nan_gradient@2"
    cmd = _cmd(tmp_path, "diverged", "grpo.steps=4", "checkpoint.max_bad_steps=2")
    code, _, err = _finish(_start(cmd, MINT_FAULTS=faults))
    assert code == 1
    lines = [line for line in err.strip().splitlines() if line.startswith("mint:")]
    assert lines[-1].startswith("mint: error: 2 consecutive steps had a non-finite gradient"), err[-2000:]
    assert "Traceback" not in err


def test_reward_errors_are_loud_and_too_many_stop_the_run(tmp_path):
    """A reward that raises unless the response is exactly the answer passes preflight (called on the answer) and
    then fails on most samples: the first error is printed in full, and the run stops over the threshold."""
    module = tmp_path / "strict_reward.py"
    module.write_text(
        "def strict(response, answer):\n    if response != answer:\n        raise ValueError('wrong')\n    return 1.0\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code, _, err = _finish(_start(_cmd(tmp_path, "loud", "data.reward=strict_reward:strict"), **env))
    assert code == 1
    assert "the reward function raised on" in err and "first: strict_reward:strict: ValueError: wrong" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("mint: error: reward 'strict_reward:strict' raised on") and "max_reward_error_frac" in last

    code, out, err = _finish(
        _start(
            _cmd(
                tmp_path,
                "tolerant",
                "data.reward=strict_reward:strict",
                "data.max_reward_error_frac=1.0",
                "grpo.steps=2",
            ),
            **env,
        )
    )
    assert code == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["reward_errors"] > 0
    assert "reward errors on" in err  # the count line of the second step


def test_lora_init_warm_starts_from_a_revision(tmp_path, reference):
    """lora.init = an exported revision directory: the new run's step-0 revision is that revision."""
    adapter = Path(reference["adapter"])
    config = load_config(
        ROOT / "recipes/smoke.toml",
        [
            "grpo.steps=1",
            "learner.num_ranks=1",
            f"lora.init={adapter}",
            f"logging.root={tmp_path}",
            "logging.name=warm",
            "logging.progress=false",
        ],
    )
    train(config)
    from mint.hub import Catalog

    with Catalog(tmp_path / "warm" / "catalog", create=False) as store:
        start = [m for m in store.list(run="warm") if m.step == 0]
    assert len(start) == 1 and start[0].id == reference["revision"]
