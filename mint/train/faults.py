"""Fault injection for tests and reliability drills: `MINT_FAULTS=nan_gradient@3,...` in the driver's environment.

A fault is a real failure the run must survive, made to happen at a chosen step, so a test can show the guard on the
path users run: the trainer's own driver and actors under real Ray and DeepSpeed. Nothing here runs unless the
variable is set; the driver reads it once and hands the parsed spec to the actors it creates.

    nan_gradient@K   every learner rank's gradient of step K becomes NaN (a diverged loss would do the same)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mint.errors import ConfigError

KINDS = ("nan_gradient",)


@dataclass(frozen=True)
class Faults:
    nan_gradient_steps: frozenset[int] = frozenset()

    def nan_gradient_at(self, step: int) -> bool:
        return step in self.nan_gradient_steps

    @classmethod
    def from_env(cls, value: str | None = None) -> Faults:
        value = os.environ.get("MINT_FAULTS", "") if value is None else value
        steps: dict[str, set[int]] = {k: set() for k in KINDS}
        for item in filter(None, (part.strip() for part in value.split(","))):
            kind, _, at = item.partition("@")
            if kind not in steps or not at.isdigit():
                raise ConfigError(f"MINT_FAULTS: {item!r} is not KIND@STEP with KIND one of {', '.join(KINDS)}")
            steps[kind].add(int(at))
        return cls(frozenset(steps["nan_gradient"]))
