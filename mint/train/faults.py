"""Fault injection for tests and reliability drills: `MINT_FAULTS=nan_gradient@3,...` in the driver's environment.

A fault is a real failure the run must survive, made to happen at a chosen step, so a test can show the guard on the
path users run: the trainer's own driver and actors under real Ray and DeepSpeed. Nothing here runs unless the
variable is set; the driver reads it once and hands the parsed spec to the actors it creates.

    nan_gradient@K   every learner rank's gradient of step K becomes NaN (a diverged loss would do the same)
    torn_metrics@K   the driver writes half of step K's metrics.jsonl line and SIGKILLs itself (`kill -9` landing
                     mid-write); Ray's processes go with it, as they fate-share with the driver that started them
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from mint.errors import ConfigError

KINDS = ("nan_gradient", "torn_metrics")


@dataclass(frozen=True)
class Faults:
    nan_gradient_steps: frozenset[int] = frozenset()
    torn_metrics_steps: frozenset[int] = frozenset()

    def nan_gradient_at(self, step: int) -> bool:
        return step in self.nan_gradient_steps

    def torn_metrics_at(self, step: int) -> bool:
        return step in self.torn_metrics_steps

    @classmethod
    def from_env(cls, value: str | None = None) -> Faults:
        value = os.environ.get("MINT_FAULTS", "") if value is None else value
        steps: dict[str, set[int]] = {k: set() for k in KINDS}
        for item in filter(None, (part.strip() for part in value.split(","))):
            kind, _, at = item.partition("@")
            if kind not in steps or not at.isdigit():
                raise ConfigError(f"MINT_FAULTS: {item!r} is not KIND@STEP with KIND one of {', '.join(KINDS)}")
            steps[kind].add(int(at))
        return cls(frozenset(steps["nan_gradient"]), frozenset(steps["torn_metrics"]))


def die_mid_write(file, text: str) -> None:
    """Write the first half of `text` to `file`, flush it to the disk, and SIGKILL this process."""
    file.write(text[: len(text) // 2])
    file.flush()
    os.fsync(file.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
