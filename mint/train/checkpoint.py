"""Checkpoints: everything a run needs to continue bit-identically after a crash, and nothing it can recompute.

    <run>/checkpoints/step_NNNNNN/
        deepspeed/          every learner rank's optimizer state and the LoRA weights (DeepSpeed's own checkpoint
                            format, frozen base excluded: `exclude_frozen_parameters`)
        rng/rank_R.pt       each learner rank's torch RNG states
        state.json          the step, the revision at that step, the data position, the driver's RNG states, the
                            recipe's result digest, the run's counters, its reward curve so far, and its first
                            (before step 1) and latest held-out eval

A checkpoint is written into `checkpoints/.step_NNNNNN.partial/`; once every rank's files and state.json are on disk
(fsynced) the directory is renamed to `step_NNNNNN`. The rename is the commit: a directory without the suffix is
complete, and a crash leaves at most a `.partial` one, which the next writer removes. Nothing takes a complete one
apart under its own name either. A checkpoint of the same step written again replaces the old one in three renames:
the old one is set aside (`.step_NNNNNN.replaced`), the new one renamed into place, and only then is the old one
deleted; an old checkpoint past `checkpoint.keep_last` is renamed to `.step_NNNNNN.discarded` before it is emptied.
`latest` puts back a checkpoint set aside by a replace that a crash cut short (its new one never reached its name)
and clears the rest, so a resume finds a whole checkpoint whichever moment a crash hit.

What is not here, because it is elsewhere or recomputed: the LoRA tensors as a revision (the catalog holds every
step's revision; state.json names it and a restore checks the learner's weights hash to it), rollout RNGs (each
step's sampling seed is derived from grpo.seed and the step), and the per-step logs (metrics.jsonl and
samples.jsonl are cut back to the checkpoint's step on resume, `mint.train.metrics.truncate_step_logs`, so a resumed
run appends without duplicating steps).
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from mint.config import RESULT_NEUTRAL
from mint.errors import ConfigError, MintError

STATE_FILE = "state.json"
PARTIAL = ".partial"  # `.step_NNNNNN.partial`: a checkpoint being written
REPLACED = ".replaced"  # `.step_NNNNNN.replaced`: the checkpoint a new one of the same step is replacing
DISCARDED = ".discarded"  # `.step_NNNNNN.discarded`: an old checkpoint being deleted


@dataclass
class RunState:
    """The driver's side of a run between two steps: plain data, written to state.json."""

    step: int = 0  # optimizer steps done (the data stream has served `step` batches)
    revision: str | None = None  # the adapter revision after `step` (step 0: the initial adapter)
    rewards: list[float] = field(default_factory=list)  # reward_mean per step, for the summary
    bad_steps: int = 0  # consecutive steps skipped for a non-finite loss or gradient
    low_kept_steps: int = 0  # consecutive steps whose trust mask kept less than grpo.min_kept_fraction
    skipped_steps: int = 0  # all skipped steps
    reward_errors: int = 0  # samples whose reward function raised, over the run
    restarts: int = 0  # learner-group restarts from a checkpoint, over the run
    eval_first: dict[str, float] | None = None  # held-out metrics before step 1, for the summary of a resumed run
    eval_last: dict[str, float] | None = None  # the latest held-out metrics


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None; what a crash in the middle of a commit left is settled
    first (`_settle`)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return None
    _settle(root)
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and (p / STATE_FILE).is_file())
    return done[-1] if done else None


def _settle(root: Path) -> None:
    """Finish what a crash cut short in `commit`: a checkpoint set aside for a replace goes back under its name when
    the new one never got there (it is whole: it was complete when it was set aside), and is deleted when the new
    one did; an old checkpoint that was being discarded is deleted."""
    for aside in sorted(root.glob(f".step_*{REPLACED}")):
        final = root / aside.name[1:].removesuffix(REPLACED)
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(aside, final)
    for gone in root.glob(f".step_*{DISCARDED}"):
        shutil.rmtree(gone, ignore_errors=True)


def begin(run_dir: Path, step: int) -> Path:
    """A fresh `.partial` directory for step's checkpoint (a leftover from a crash is removed first)."""
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        _settle(root)
    partial = root / f".step_{step:06d}{PARTIAL}"
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "rng").mkdir(parents=True)
    return partial


def commit(partial: Path, state: RunState, result_digest: str, keep_last: int) -> Path:
    """Write state.json, fsync everything under `partial`, rename it into place (an old checkpoint of the same step
    is set aside first and deleted after), and drop old checkpoints (each renamed aside before it is emptied)."""
    doc = {"version": 1, "result_digest": result_digest, "state": asdict(state), "driver_rng": _driver_rng()}
    (partial / STATE_FILE).write_text(json.dumps(doc, indent=1, sort_keys=True))
    for path in sorted(partial.rglob("*")):
        _fsync(path)
    _fsync(partial)
    final = partial.parent / partial.name[1:].removesuffix(PARTIAL)
    replaced = final.with_name(f".{final.name}{REPLACED}")
    if final.exists():  # the same step written again (a restart re-ran it): the old one goes once the new one is in
        os.rename(final, replaced)
    os.rename(partial, final)
    _fsync(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)
    for old in sorted(p for p in final.parent.glob("step_*") if p.is_dir())[:-keep_last]:
        discarded = old.with_name(f".{old.name}{DISCARDED}")
        os.rename(old, discarded)  # never a half-deleted checkpoint under its name, where `latest` would take it
        shutil.rmtree(discarded, ignore_errors=True)
    return final


def read(checkpoint: Path, result_digest: str | None = None) -> RunState:
    """The RunState of a complete checkpoint, with the driver's RNGs restored. With `result_digest`, refuse (one
    line) a checkpoint written by a recipe that computes something else."""
    try:
        doc = json.loads((checkpoint / STATE_FILE).read_text())
        state = RunState(**doc["state"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MintError(f"checkpoint {checkpoint}: unreadable state ({type(e).__name__}: {e})") from None
    if result_digest is not None and doc.get("result_digest") != result_digest:
        raise ConfigError(
            f"--resume: the recipe differs from the one {checkpoint.name} was written with in keys that change "
            f"the result (only these may change: {changeable_keys()}); start a new run with another logging.name"
        )
    _restore_driver_rng(doc["driver_rng"])
    return state


def changeable_keys() -> str:
    """The keys a resumed run may change, as read's refusal names them: RESULT_NEUTRAL (the keys result_digest
    leaves out), then the two cases in which result_digest counts one of them after all."""
    return (
        ", ".join(RESULT_NEUTRAL) + "; but not grpo.steps under a cosine learner.lr_schedule, nor checkpoint.every "
        "with rollout.max_staleness >= 1"
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _driver_rng() -> dict:
    """The driver process's RNG states (user reward code may draw from any of them), as JSON."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }


def _restore_driver_rng(rng: dict) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng["torch"])), dtype=torch.uint8))
