"""Expert parallel learner steps with replay micro-batches against one response at a time.

Runs what a user runs, twice, alternating, each in its own process:

    mint train recipes/smoke.toml learner.num_ranks=2 learner.expert_parallel=2 grpo.steps=N \
        longstraw.replay_budget_mb=B

with B = the recipe's 8 MiB (a group's 8 responses of up to 4 tokens replay as one micro-batch, planned by every rank
over the lengths its EP group agrees on) and B = 0 (one forward and one backward per response, which expert parallel
always did before the plan was agreed). The figure is the learner step (`learn_s` in metrics.jsonl: inner steps,
EP all-to-alls, reduction, optimizer step), median over the steps after the first; the last line printed is one JSON
object with `one_at_a_time_over_batched_learn_s` and each run's median, wall time and rewards.

Run: python bench/ep_replay.py [--steps 40] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGETS = {"batched": 8.0, "one_at_a_time": 0.0}


def run(name: str, budget: float, steps: int, root: str) -> dict:
    cmd = [sys.executable, "-m", "mint.cli", "train", "recipes/smoke.toml", "learner.num_ranks=2",
           "learner.expert_parallel=2", f"grpo.steps={steps}", f"longstraw.replay_budget_mb={budget}",
           f"logging.root={root}", f"logging.name={name}", "logging.progress=false"]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: mint train failed:\n{proc.stderr[-3000:]}")
    wall = time.time() - t0
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(os.path.join(summary["run_dir"], "metrics.jsonl")) as f:
        learn = [json.loads(line)["learn_s"] for line in f][1:]
    return {"learn_s_median": statistics.median(learn), "wall_s": round(wall, 1),
            "reward_first": summary["reward_first"], "reward_last": summary["reward_last"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="ep-replay-")
    results: dict[str, list[dict]] = {name: [] for name in BUDGETS}
    for r in range(args.rounds):
        for name, budget in BUDGETS.items():
            row = run(f"{name}_{r}", budget, args.steps, root)
            print(json.dumps({"run": name, "round": r, **row}))
            results[name].append(row)
    median = {name: statistics.median(row["learn_s_median"] for row in rows) for name, rows in results.items()}
    print(json.dumps({"bench": "ep_replay", "steps": args.steps, "rounds": args.rounds, "learn_s_median": median,
                      "one_at_a_time_over_batched_learn_s": round(median["one_at_a_time"] / median["batched"], 2),
                      "runs": results}))  # fmt: skip


if __name__ == "__main__":
    main()
