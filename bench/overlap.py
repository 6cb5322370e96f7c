"""Overlapped steps vs the on-policy loop: seconds per step at rollout.max_staleness = 0 and 1, side by side.

Both runs are the smoke recipe (the embedded tiny Qwen3-MoE, synthetic first_last task) through the real trainer:
local Ray, one learner rank on DeepSpeed (gloo), one rollout actor, one CPU bundle and one torch thread each. Only
rollout.max_staleness differs. With k = 1 the rollout of step t + 1 runs on the rollout actor while the learner
trains on step t, each revision's load is queued behind it instead of awaited, and step t + 1's learning is queued on
the learner before step t's revision is published (the learner does not wait for the driver).

Seconds per step are each run's mean `step_s` over steps 2..N (step 1 cannot overlap; N = --steps): from the start
of the step's wait for samples to the end of its publish. checkpoint.every = 0 (the overlap would drain at every
checkpoint step) and revisions are exported as adapter directories at the last step only, so the measured steps are
rollout, learn and publish. The runs go one after the other, alternating k = 0 and k = 1 for --rounds rounds, so a
change in the box's load falls on both.

    python bench/overlap.py                  # 40 steps per run, one round
    python bench/overlap.py --steps 60 --rounds 2

--verifier-latency-ms L scores the rewards through a remote-verifier stand-in: the recipe's exact_match behind an
`await asyncio.sleep(L)` (one batch's calls wait concurrently, as async rewards do; rewards are part of the rollout
actor's work). It lengthens rollout without using a core, as a sandbox or judge call does; the learning curve is
unchanged. The smoke task's responses end at EOS after about 2 tokens, so rollout.max_tokens cannot lengthen them.

The last stdout line is one JSON object: seconds per step of each, `sync_over_async_step_seconds` (k=0 / k=1; the
target is >= 1.3), the phase means (rollout_s is the wait for samples the learner could not hide), and each
run's learning curve (reward per step, and the means of the first and last 10 steps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout_s", "learn_s", "sync_s", "idle_s", "step_s")
LATENCY_ENV = "MINT_BENCH_VERIFIER_LATENCY_S"  # read by the rollout actor's copy of this module


async def slow_exact_match(response: str, answer: str) -> float:
    """exact_match behind a remote verifier's round trip of MINT_BENCH_VERIFIER_LATENCY_S seconds."""
    from mint.rl.rewards import exact_match

    await asyncio.sleep(float(os.environ.get(LATENCY_ENV, "0")))
    return exact_match(response, answer)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=1, help="k=0, k=1 pairs run one after the other")
    parser.add_argument("--max-tokens", type=int, default=4, help="rollout.max_tokens (the recipe's 4)")
    parser.add_argument("--prompts", type=int, default=8, help="rollout.prompts_per_step (the recipe's 8)")
    parser.add_argument("--group-size", type=int, default=8, help="rollout.group_size (the recipe's 8)")
    parser.add_argument("--verifier-latency-ms", type=float, default=0.0, help="remote reward stand-in (0: none)")
    parser.add_argument("--recipe", default=str(ROOT / "recipes/smoke.toml"))
    return parser.parse_args()


def run_once(args: argparse.Namespace, k: int, root: Path, name: str) -> list[dict]:
    """One training run at rollout.max_staleness = k; its metrics.jsonl rows."""
    from mint.config import load_config
    from mint.train.driver import train

    config = load_config(
        args.recipe,
        [
            f"grpo.steps={args.steps}",
            f"rollout.max_staleness={k}",
            f"rollout.max_tokens={args.max_tokens}",
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.group_size={args.group_size}",
            "rollout.num_actors=1",
            "learner.num_ranks=1",
            "ray.learner_cpus=1",
            "ray.rollout_cpus=1",
            "ray.torch_threads=1",
            "checkpoint.every=0",
            f"catalog.export_every={args.steps}",
            "logging.progress=false",
            f"logging.root={root}",
            f"logging.name={name}",
            *([f"data.reward={Path(__file__).stem}:slow_exact_match"] if args.verifier_latency_ms else []),
        ],
    )
    summary = train(config)
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    print(
        f"overlap: {name}: {summary['seconds']} s, reward {summary['reward_first']} -> {summary['reward_last']}",
        file=sys.stderr,
    )
    return rows


def describe(runs: list[list[dict]]) -> dict:
    """Phase means over steps 2..N of every run of one k, and the first run's learning curve."""
    steady = [row for rows in runs for row in rows[1:]]
    out = {f"{p}_mean": round(statistics.fmean(r[p] for r in steady), 4) for p in PHASES}
    out["step_s_median"] = round(statistics.median(r["step_s"] for r in steady), 4)
    out["staleness_mean"] = round(statistics.fmean(r.get("staleness_mean", 0.0) for r in steady), 3)
    out["trust_kept_frac_min"] = round(min(r["trust_kept_frac"] for r in steady), 4)
    rewards = [round(r["reward_mean"], 4) for r in runs[0]]
    n = min(10, len(rewards))
    out["reward_first10"] = round(statistics.fmean(rewards[:n]), 4)
    out["reward_last10"] = round(statistics.fmean(rewards[-n:]), 4)
    out["rewards"] = rewards
    return out


def main() -> None:
    args = parse_args()
    if args.verifier_latency_ms:
        # The actors import the reward by module name: they inherit this environment from the Ray this run starts.
        os.environ[LATENCY_ENV] = str(args.verifier_latency_ms / 1000)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
        )
        sys.path.insert(0, str(Path(__file__).parent))
    runs: dict[int, list[list[dict]]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="mint-overlap-") as tmp:
        for r in range(args.rounds):
            order = (0, 1) if r % 2 == 0 else (1, 0)  # alternate, so a drift in the box's load hits both
            for k in order:
                runs[k].append(run_once(args, k, Path(tmp), f"k{k}_round{r}"))
    sync, overlap = describe(runs[0]), describe(runs[1])
    result = {
        "steps": args.steps,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "prompts_per_step": args.prompts,
        "group_size": args.group_size,
        "verifier_latency_ms": args.verifier_latency_ms,
        "sync_step_seconds": sync["step_s_mean"],
        "async_step_seconds": overlap["step_s_mean"],
        "sync_over_async_step_seconds": round(sync["step_s_mean"] / overlap["step_s_mean"], 3),
        "sync_over_async_step_seconds_median": round(sync["step_s_median"] / overlap["step_s_median"], 3),
        "sync": sync,
        "async": overlap,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
