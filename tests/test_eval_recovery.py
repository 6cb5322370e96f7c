"""An eval pass survives a rollout actor that dies in it, as a training rollout does (real local Ray and DeepSpeed on
gloo, the smoke recipe on the embedded tiny Qwen3-MoE).

Eval used to gather its shards with a bare ray.get: Ray restarted the dead actor and retried the eval call on it, the
restarted actor (holding no revision) refused with StaleRevision, and that ended the run. Eval now goes through the
rollouts' own recovery (RolloutFleet.collect, mint.train.rollout_fleet): reload the revision, redo the shard with its
seed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mint.config import load_config
from mint.train.driver import train

ROOT = Path(__file__).resolve().parents[1]
REWARD_MODULE = "eval_kill_rewards"
# Exact match, except that the first time it scores a held-out answer in a Ray worker, the process it runs in (the
# rollout actor, mid-eval) kills itself: a SIGKILL of this run's own actor, found without searching for processes.
REWARD_SOURCE = """
import os
import signal

def exact_or_die(response, answer):
    if answer.startswith("held-out") and os.getpid() != {driver_pid}:
        try:
            os.close(os.open({marker!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass  # killed once already: this is the redone shard
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    return float(response.strip() == answer.strip())
"""


@pytest.mark.slow
def test_a_rollout_actor_killed_during_eval_is_restarted_and_the_run_finishes_with_its_evals(tmp_path, monkeypatch):
    """The rollout actor SIGKILLs itself while scoring the eval before step 1: Ray restarts it, the eval call retried
    on it is refused (StaleRevision: the new actor holds no revision), and the run used to end there. Now the shard is
    redone after a reload and the run finishes with its first and last eval and the restart counted."""
    marker = tmp_path / "killed_once"
    (tmp_path / f"{REWARD_MODULE}.py").write_text(REWARD_SOURCE.format(driver_pid=os.getpid(), marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver imports the reward; the Ray workers get PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": f"held-out {i}"}) + "\n" for i in range(4)))
    config = load_config(
        ROOT / "recipes/smoke.toml",
        [
            "grpo.steps=2",
            "learner.num_ranks=1",
            "rollout.prompts_per_step=4",
            f"data.reward={REWARD_MODULE}:exact_or_die",
            f"eval.source={held_out}",
            "eval.samples=2",
            f"logging.root={tmp_path}",
            "logging.name=eval_kill",
            "logging.progress=false",
        ],
    )
    summary = train(config)
    assert marker.exists()  # the actor did die in the eval pass
    assert summary["steps"] == 2 and not summary["interrupted"]
    assert "eval_pass@1_first" in summary and "eval_pass@1_last" in summary, summary
    lines = [json.loads(line) for line in (tmp_path / "eval_kill/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "eval_pass@1" in m] == [2]
    assert lines[-1]["rollout_restarts"] >= 1
