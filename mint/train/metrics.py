"""Per-step metrics: one JSON line per step in <run>/metrics.jsonl, wandb when enabled, and a progress bar.

The run appends to the per-step logs in STEP_LOGS (every row carries its `step`); a resumed or restarted run first
cuts each back to its checkpoint's step (`truncate_step_logs`), so no step is logged twice.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from mint.config import Config
from mint.train.faults import Faults, die_mid_write

BAR_KEYS = ("reward_mean", "loss", "kl", "tokens_per_s")
# Every per-step JSONL file the run appends to, in the run directory: a resume cuts each back to its checkpoint.
STEP_LOGS = ("metrics.jsonl", "samples.jsonl")


def truncate_step_logs(directory: Path, step: int) -> None:
    """Keep the rows of steps <= `step` in every per-step log (each file replaced atomically), so a resumed run
    appends without duplicates. A line that does not parse is dropped: only a write a crash cut short leaves one
    (the last line), and the next row must not be glued to it."""
    for name in STEP_LOGS:
        path = Path(directory) / name
        if not path.exists():
            continue
        kept = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("step", 0) <= step:
                kept.append(line + "\n")
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write("".join(kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


class RunLogger:
    def __init__(self, config: Config, directory: Path, initial: int = 0, faults: Faults | None = None):
        self.path = Path(directory) / "metrics.jsonl"
        self._faults = faults or Faults()
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - open for the whole run, closed in close()
        self._wandb = None
        if config.logging.wandb:
            import wandb

            # Offline unless the user configured an account: a run must never block on a login prompt.
            if not os.environ.get("WANDB_API_KEY"):
                os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = wandb.init(
                project=config.logging.wandb_project,
                name=config.logging.name,
                config=config.to_dict(),
                dir=str(directory),
            )
        self._bar = None
        if config.logging.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=config.grpo.steps, initial=initial, desc="grpo", file=sys.stderr, dynamic_ncols=True)

    def note(self, line: str) -> None:
        """One line on the console (stderr), above the progress bar when there is one."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def log(self, metrics: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        line = json.dumps(clean, sort_keys=True) + "\n"
        if self._faults.torn_metrics_at(metrics["step"]):
            die_mid_write(self._file, line)
        self._file.write(line)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if isinstance(v, (int, float))}, step=metrics["step"])
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix({k: f"{metrics[k]:.3g}" for k in BAR_KEYS if isinstance(metrics.get(k), float)})

    def samples(self, rows: list[dict]) -> None:
        """A few prompts with completions, rewards and advantages: samples.jsonl, a small console table, wandb."""
        if not rows:
            return
        with open(self.path.with_name("samples.jsonl"), "a") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        for row in rows:
            prompt, completion = _short(row["prompt"]), _short(row["completion"])
            self.note(
                f"  step {row['step']:>5}  r={row['reward']:.2f} A={row['advantage']:+.2f}  {prompt} -> {completion}"
            )
        if self._wandb is not None:
            import wandb

            columns = [c for c, v in rows[0].items() if isinstance(v, (str, int, float))]  # an episode's turns: jsonl
            table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
            self._wandb.log({"samples": table}, step=rows[0]["step"])

    def close(self) -> None:
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()


def _short(text: str, width: int = 48) -> str:
    one = " ".join(str(text).split())
    return one if len(one) <= width else one[: width - 1] + "…"
