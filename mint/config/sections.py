"""The recipe sections that say where and how a run runs, logs, evaluates, publishes and checkpoints (the sections
of what a step computes are in mint.config.schema, which assembles both into Config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mint.config.knobs import knob


@dataclass(frozen=True)
class RayConfig:
    address: str = knob("", "Ray cluster to join (e.g. auto or ray://host:10001); empty starts a local one.")
    learner_cpus: float = knob(1.0, "CPUs reserved per learner rank.", gt=0.0)
    learner_gpus: float = knob(0.0, "GPUs per learner rank; 0 runs the learner on CPU.", min=0.0)
    rollout_cpus: float = knob(1.0, "CPUs reserved per rollout actor.", gt=0.0)
    rollout_gpus: float = knob(0.0, "GPUs per rollout actor.", min=0.0)
    torch_threads: int = knob(1, "torch threads per actor; keep actors x threads <= cores.", min=1)
    placement: Literal["nodes", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = knob(
        "nodes",
        "nodes: Mint's per-node layout (learner ranks fill nodes in order, parallel groups stay in a node, rollout "
        "actors on their own nodes or GPUs; docs/multinode.md); PACK, SPREAD, STRICT_PACK, STRICT_SPREAD: one "
        "bundle per actor, placed by Ray with that strategy.",
    )
    colocate: bool = knob(
        False,
        "Let rollout actors share nodes and GPUs with learner ranks (fractional GPUs, e.g. learner_gpus=0.5 "
        "rollout_gpus=0.5); false keeps them on nodes or GPUs of their own.",
    )


@dataclass(frozen=True)
class LoggingConfig:
    name: str = knob("mint", "Run name; the run directory is <root>/<name>.")
    root: str = knob("runs", "Folder that holds run directories.")
    wandb: bool = knob(False, "Log to Weights & Biases (offline unless WANDB_API_KEY or WANDB_MODE says otherwise).")
    wandb_project: str = knob("mint", "wandb project name.")
    progress: bool = knob(True, "Show a progress bar on stderr.")
    samples_every: int = knob(
        10,
        "Every N steps log a few prompts with completions, rewards and advantages (samples.jsonl, console, wandb).",
        min=0,
    )
    samples_per_step: int = knob(2, "Groups shown each time samples are logged (their first two responses).", min=1)


@dataclass(frozen=True)
class EvalConfig:
    source: str = knob(
        "", "Held-out prompts (a local .jsonl/.parquet/.json/.csv file or saved dataset directory); empty: no eval."
    )
    every: int = knob(
        25, "Evaluate every N steps, and before the first and after the last step (0: only those).", min=0
    )
    samples: int = knob(1, "Responses per eval prompt; pass@k is reported for k = samples when above 1.", min=1)
    temperature: float = knob(0.0, "Eval sampling temperature (0: greedy).", min=0.0, max=10.0)
    max_prompts: int = knob(0, "Evaluate on the first N prompts only (0: all).", min=0)
    pass_threshold: float = knob(1.0, "A response passes when its reward is at least this.", min=0.0)


@dataclass(frozen=True)
class CatalogConfig:
    path: str = knob(
        "",
        "Revision catalog the run publishes every step's revision to (several runs may share one); "
        "empty means <run dir>/catalog.",
    )
    export_every: int = knob(
        10,
        "Also export the revision as a PEFT adapter directory in <run dir>/adapters every N steps "
        "(the last step always); retention (keep_last) runs at each export.",
        min=1,
    )
    keep_last: int = knob(
        10,
        "Retention: revisions of this run whose tensors stay in the catalog (the N latest, plus tagged and named "
        "ones; entries and lineage always stay), and adapter directories kept in <run dir>/adapters. 0 keeps all "
        "(at 30B-A3B rank 32, 2.6 GB per step: docs/mint.md, Disk).",
        min=0,
    )
    rollout_records: Literal["full", "no_routes", "off"] = knob(
        "no_routes",
        "Rollout records kept per step in the catalog (tokens, logprobs, rewards, linked to the sampling revision): "
        "no_routes, full (also the R3 routes: L x k bytes per token, 32x the rest at 30B-A3B), or off.",
    )


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = knob(
        25,
        "Write a resumable checkpoint (every rank's optimizer state, the data position, RNGs, metrics) every N steps "
        "and at the end; 0 only at the end. `mint train RECIPE --resume` continues from the latest one.",
        min=0,
    )
    keep_last: int = knob(2, "Complete checkpoints kept in <run dir>/checkpoints (older ones are deleted).", min=1)
    max_restarts: int = knob(
        2,
        "Times the driver restarts the actors from the latest checkpoint after a learner rank dies, before it "
        "stops (rollout actors are restarted by Ray on their own).",
        min=0,
    )
    max_bad_steps: int = knob(
        3, "Consecutive steps with a non-finite loss or gradient (skipped, never published) that stop the run.", min=1
    )
