"""`knob`: how every recipe field is declared (default, help string, range), shared by the schema's modules."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def knob(default: Any, help: str, *, min: float | None = None, max: float | None = None, gt=None):
    """A config field: default, help string, and the range validated at load. A mode's choices are its annotation,
    `Literal[...]` (`choices`)."""
    meta = {"help": help, "min": min, "max": max, "gt": gt}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
