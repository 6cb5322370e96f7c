"""The pieces of one GRPO step that need no Ray: advantages, the learner's plans, and what publishing a revision
writes.

Weight sync *is* revision publish, in three explicit steps the driver takes (mint.train.driver):

    admit      `RunCatalog.admit`: the learner's new adapter may be published only when every tensor is finite
               (NaN/inf refused in one line: they never reach an engine or the catalog); its sha256 is the revision
               id, with lineage to the revision before it
    broadcast  the rollout fleet loads that id (mint.train.rollout_fleet; the bytes go straight from learner rank 0's
               object store to each actor, no driver hop, and each actor refuses bytes that do not hash to the id)
    write      `RunCatalog.write`, on a CatalogWriter thread: the revision and the step's rollout records go into the
               catalog (<run>/catalog by default) while the learner trains on the next step

Every `catalog.export_every` steps the revision is also exported to <run>/adapters as a PEFT adapter directory
(`save_revision`). The driver's `sync_s` metric times admit and broadcast (docs/rollout.md).
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mint.config import Config
from mint.hub import Catalog, from_bytes
from mint.rl.grpo import group_advantages_batch, zero_variance_mask
from mint.train.context_parallel import data_parallel_size, replicate_plans
from mint.train.inner_step import GroupBatch, MicroStep, StepPlan
from mint.train.rollout_actor import GroupResult


@dataclass
class Revision:
    """A published adapter revision: its id (the sha256 of its tensors), the step that made it, its bytes."""

    id: str
    step: int
    ref: object = field(repr=False)  # its safetensors bytes in the object store (learner rank 0's result): reloads
    parent: str | None = None


@functools.lru_cache(maxsize=8)
def _fingerprint(model_path: str) -> str:
    """The base's fingerprint, read from its files once per run, not every step (up to 128 MiB of reads)."""
    from mint.hub import base_fingerprint

    return base_fingerprint(model_path)


class CatalogWriter:
    """The catalog copies of a run's revisions, written on one worker thread in publish order, so the write and fsync
    of revision t (and its step's rollout records) run while the learner trains on step t + 1.

    A failed write (a full disk, a parent missing from the catalog) is raised by the first `submit` that finds it
    finished, or by `wait`: the run stops a step or two later, and at the latest before its next export, checkpoint
    or end. Call `wait` before anything reads the catalog (an export, a checkpoint, the end of the run); `close`
    waits, then ends the thread.
    """

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mint-catalog")
        self._pending: list[Future] = []
        self.seconds = 0.0  # the seconds of the latest copy seen to finish (the catalog_s metric)

    def submit(self, fn: Callable[..., float], *args) -> None:
        """Queue `fn(*args)` (a write that returns its seconds) behind the writes queued before it."""
        self._raise_failed()
        self._pending.append(self._pool.submit(fn, *args))

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            self.seconds = future.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> CatalogWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # the error already on its way out tells the story
            self.close()

    def _raise_failed(self) -> None:
        while self._pending and self._pending[0].done():
            self.seconds = self._pending.pop(0).result()


@dataclass(frozen=True)
class Admitted:
    """A step's adapter the driver may publish: its tensors (all finite) and the revision they make."""

    step: int
    revision: Revision  # the new revision; the parent itself when the update left the adapter unchanged
    parent: Revision | None
    tensors: dict = field(repr=False)

    @property
    def new(self) -> bool:
        """Whether there is anything to broadcast (an unchanged adapter is the revision the actors hold already)."""
        return self.parent is None or self.revision.id != self.parent.id


@dataclass(frozen=True)
class RunCatalog:
    """The run's catalog, and what every revision of the run is stored with."""

    store: Catalog
    config: Config
    model_path: str  # the driver's copy of the base: its fingerprint goes into every revision
    adapter_config: dict  # adapter_config.json as the learner's PEFT model writes it

    def admit(self, step: int, parent: Revision | None, data: bytes, ref) -> Admitted:
        """Decide whether step `step`'s adapter (`data`, its safetensors bytes; `ref`, their object ref in learner
        rank 0's store) may be published: every tensor finite (one MintError line otherwise), hashed to the revision
        id. An update that left the adapter unchanged (the id of `parent`) admits the parent again."""
        tensors = from_bytes(data)
        rid = self.store.admit(tensors, self.config.logging.name, step)
        if parent is not None and rid == parent.id:
            return Admitted(step, parent, parent, tensors)
        return Admitted(step, Revision(rid, step, ref, parent.id if parent is not None else None), parent, tensors)

    def write(self, admitted: Admitted, results: list[GroupResult] | None = None, metrics: dict | None = None) -> float:
        """Write an admitted revision into the catalog, with the rollout records of the step that made it (stored
        under the revision that sampled them: the parent, or an older one when rollout.max_staleness lets rollout
        run ahead); its seconds. Writes no tensors the catalog holds already."""
        from mint.hub import write_step

        t0 = time.perf_counter()
        config, step, parent = self.config, admitted.step, admitted.parent
        run = config.logging.name
        if results and parent is not None:
            write_step(self.store, run, step, results[0].revision or parent.id, results, config.catalog.rollout_records)
        self.store.put(
            admitted.tensors,
            self.adapter_config,
            run=run,
            step=step,
            parent=parent.id if parent is not None else None,
            recipe_hash=config.digest(),
            base_model=config.model.path,
            base_fingerprint=_fingerprint(self.model_path),
            metrics=metrics or {},
            admitted=admitted.revision.id,  # checked and hashed by admit already
        )
        return time.perf_counter() - t0


def plan_step(
    groups: list[GroupBatch], world_size: int, step: int = 0, context_parallel: int = 1, expert_parallel: int = 1
) -> list[StepPlan]:
    """Assign groups to ranks (fewest tokens first) and pad every rank to the same number of micro-steps.

    Context parallel (C > 1): the groups go to the D = world_size / C data-parallel replicas, and the C ranks of a
    replica get its plan (`mint.train.context_parallel`, whose layout depends on expert_parallel)."""
    if context_parallel > 1:
        plans = plan_step(groups, data_parallel_size(world_size, context_parallel), step)
        return replicate_plans(plans, world_size, context_parallel, expert_parallel)
    tokens = [sum(len(r) for r in g.responses) for g in groups]  # what a rank replays (episode tails whole)
    loads = [0] * world_size
    assigned: list[list[GroupBatch]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(groups)), key=lambda i: -tokens[i]):
        rank = loads.index(min(loads))
        assigned[rank].append(groups[i])
        loads[rank] += tokens[i]
    n_micro = max(len(a) for a in assigned)
    # The aggregation counts the tokens that carry loss: an episode's observation tokens are context only.
    total_tokens = sum(sum(g.loss_lengths) for g in groups)
    total_seqs = sum(len(g.responses) for g in groups)
    return [
        StepPlan(
            [MicroStep(g, True) for g in a] + [MicroStep(groups[0], False)] * (n_micro - len(a)),
            total_tokens,
            total_seqs,
            step,
        )
        for a in assigned
    ]


def to_batches(results: list[GroupResult], adv_B_G: torch.Tensor) -> list[GroupBatch]:
    return [
        GroupBatch(
            prompt_tokens_P=res.rollout.prompt_tokens_P,
            responses=[c.tokens_R for c in res.rollout.completions],
            rollout_logprobs=[c.logprobs_R for c in res.rollout.completions],
            adv_G=adv_B_G[b],
            prompt_routes_P1_L_K=res.rollout.prompt_routes_P1_L_K,
            routes=[c.routes_R_L_K for c in res.rollout.completions],
            indexer=[c.indexer_R_I_K for c in res.rollout.completions],
            loss_masks=_loss_masks(res.rollout.completions),
        )
        for b, res in enumerate(results)
    ]


def _loss_masks(completions) -> list[torch.Tensor] | None:
    """Episode tails' masks (observation tokens carry no loss); None when every completion is a plain response."""
    if all(c.loss_mask_R is None for c in completions):
        return None
    return [
        c.loss_mask_R if c.loss_mask_R is not None else torch.ones(len(c.tokens_R), dtype=torch.bool)
        for c in completions
    ]


def make_batches(config: Config, results: list[GroupResult]) -> tuple[list[GroupBatch], torch.Tensor]:
    """Group-relative advantages, then the learner's batches (zero-variance groups dropped when asked)."""
    rewards_B_G = torch.tensor([r.rewards_G for r in results], dtype=torch.float32)
    adv_B_G = group_advantages_batch(rewards_B_G, scale_std=config.grpo.scale_std)
    batches = to_batches(results, adv_B_G)
    if config.grpo.filter_zero_variance:
        batches = [b for b, keep in zip(batches, zero_variance_mask(rewards_B_G).tolist(), strict=True) if keep]
    return batches, rewards_B_G


def save_revision(config: Config, out: Path, store: Catalog, rev: Revision) -> Path:
    """Export the revision as a PEFT adapter directory in <run>/adapters/step_NNNNNN, then apply retention:
    `catalog.keep_last` revisions of this run keep their tensors in the catalog (plus tagged and named ones; entries
    and lineage stay) and as adapter directories."""
    from mint.hub import export_peft

    target = out / "adapters" / f"step_{rev.step:06d}"
    if not target.exists():
        export_peft(store, rev.id, target)
    if config.catalog.keep_last:
        store.gc(config.catalog.keep_last, run=config.logging.name)
        kept = sorted((out / "adapters").glob("step_*"))
        for old in kept[: -config.catalog.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return target
