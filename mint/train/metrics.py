"""Per-step metrics: one JSON line per step in <run>/metrics.jsonl, wandb when enabled, and a progress bar."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from mint.config import Config

BAR_KEYS = ("reward_mean", "loss", "kl", "tokens_per_s")


class RunLogger:
    def __init__(self, config: Config, directory: Path, initial: int = 0):
        self.path = Path(directory) / "metrics.jsonl"
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
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")
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

            columns = list(rows[0])
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
