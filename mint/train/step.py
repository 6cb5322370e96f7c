"""The pieces of one GRPO step between rollout and logging: advantages, the learner's plans, learn, publish.

Weight sync *is* revision publish: each step's LoRA tensors become a revision in the catalog (<run>/catalog by
default, with lineage and the step's rollout records), and every `save_every` steps are also exported to
<run>/adapters as a PEFT adapter directory. The rollout actors take the bytes straight from learner rank 0's object
store (no driver hop); the driver checks them for NaN/inf and hashes them, and a CatalogWriter writes the catalog copy
while the learner trains on the next step. The driver's `sync_s` metric times the sync (docs/rollout.md).
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

from longstraw.trust import TrustCounts
from mint.config import Config
from mint.errors import MintError
from mint.hub import Catalog, from_bytes
from mint.rl.grpo import group_advantages_batch, zero_variance_mask
from mint.train.cluster import Cluster, finish_sync, gather, load_revision, submit_sync
from mint.train.context_parallel import cp_group_ranks, data_parallel_size, replicate_plans
from mint.train.learner import GroupBatch, MicroStep, StepPlan
from mint.train.rollout_actor import GroupResult


@dataclass
class Revision:
    id: str
    step: int
    ref: object = field(repr=False)  # its safetensors bytes in the object store (learner rank 0's result): reloads
    parent: str | None = None


@functools.lru_cache(maxsize=8)
def _fingerprint(model_path: str) -> str:
    """The base's fingerprint, read from its files once per run, not every step (up to 128 MiB of reads)."""
    from mint.hub import base_fingerprint

    return base_fingerprint(model_path)


def request_state(cluster: Cluster) -> list:
    """Ask every learner rank for the adapter's safetensors bytes (rank 0's result holds them; every rank takes part,
    since the state may be gathered), without waiting."""
    return [learner.lora_state_bytes.remote() for learner in cluster.learners]


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

    def submit(self, fn: Callable[[], float]) -> None:
        self._raise_failed()
        self._pending.append(self._pool.submit(fn))

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


def publish(
    cluster: Cluster,
    store: Catalog,
    config: Config,
    model_path: str,
    adapter_config: dict,
    step: int,
    parent: Revision | None,
    results: list[GroupResult] | None = None,
    metrics: dict | None = None,
    load: Callable[[Cluster, str, object], None] = load_revision,
    writer: CatalogWriter | None = None,
    refs: list | None = None,
) -> Revision:
    """Publish the learner's LoRA state as a catalog revision and hot-load it into every rollout actor by id.

    The step's rollout records are stored beside it, under the revision that sampled them (`parent`, or an older one
    when rollout.max_staleness lets rollout run ahead). The actors receive the id with the safetensors bytes and
    refuse bytes that do not hash to it. `load(cluster, id, bytes_ref)` hands it to them: load_revision waits for
    every actor; the overlapped loop queues the loads behind the rollouts in flight. Either way the bytes go from
    learner rank 0's object store to the actors (no driver hop). With a `writer` the catalog copy is written off
    the critical path (CatalogWriter); without, before this returns. An update that left the adapter unchanged
    (same id as the parent) publishes nothing new and returns the parent. `refs`: every rank's `lora_state_bytes`
    call, when the caller made them already (`request_state`: the overlapped loop queues the next step's learning
    behind them).
    """
    # Direct sync (the default `load`): the actors fetch rank 0's bytes from the learner's object store and hash
    # them once while the driver fetches its own copy for the catalog; the ids must agree.
    direct = load is load_revision
    refs = refs or request_state(cluster)
    syncs = submit_sync(cluster, refs[0]) if direct else None
    data = gather(refs, cluster, "publish")[0]
    tensors = from_bytes(data)
    rid = store.admit(tensors, config.logging.name, step)  # NaN/inf never reach an engine
    copy = functools.partial(
        _catalog_copy, store, config, model_path, adapter_config, step, parent, results, metrics, tensors, rid
    )
    if writer is None:
        copy()
    else:
        writer.submit(copy)
    if direct:
        synced, _ = finish_sync(cluster, syncs, refs[0])
        if synced != rid:
            raise MintError(f"weight sync: the rollout actors hold {synced[:12]}, the learner's bytes are {rid[:12]}")
    if parent is not None and rid == parent.id:
        return parent
    rev = Revision(rid, step, refs[0], parent.id if parent is not None else None)
    if not direct:
        load(cluster, rid, refs[0])
    return rev


def _catalog_copy(store, config, model_path, adapter_config, step, parent, results, metrics, tensors, rid) -> float:
    """Write one revision (and the rollout records of the step that made it) into the catalog; its seconds."""
    from mint.hub import write_step

    t0 = time.perf_counter()
    run = config.logging.name
    if results and parent is not None:
        write_step(store, run, step, results[0].revision or parent.id, results, config.mint.rollout_records)
    store.put(  # writes nothing for tensors already in the catalog
        tensors,
        adapter_config,
        run=run,
        step=step,
        parent=parent.id if parent is not None else None,
        recipe_hash=config.digest(),
        base_model=config.model.path,
        base_fingerprint=_fingerprint(model_path),
        metrics=metrics or {},
        admitted=rid,  # checked and hashed by publish already
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
    tokens = [sum(len(r) for r in g.responses) for g in groups]
    loads = [0] * world_size
    assigned: list[list[GroupBatch]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(groups)), key=lambda i: -tokens[i]):
        rank = loads.index(min(loads))
        assigned[rank].append(groups[i])
        loads[rank] += tokens[i]
    n_micro = max(len(a) for a in assigned)
    total_tokens, total_seqs = sum(tokens), sum(len(g.responses) for g in groups)
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
        )
        for b, res in enumerate(results)
    ]


def make_batches(config: Config, results: list[GroupResult]) -> tuple[list[GroupBatch], torch.Tensor]:
    """Group-relative advantages, then the learner's batches (zero-variance groups dropped when asked)."""
    rewards_B_G = torch.tensor([r.rewards_G for r in results], dtype=torch.float32)
    adv_B_G = group_advantages_batch(rewards_B_G, scale_std=config.grpo.scale_std)
    batches = to_batches(results, adv_B_G)
    if config.grpo.filter_zero_variance:
        batches = [b for b, keep in zip(batches, zero_variance_mask(rewards_B_G).tolist(), strict=True) if keep]
    return batches, rewards_B_G


def submit_learn(cluster: Cluster, batches: list[GroupBatch], step: int) -> list:
    """Queue one optimizer step on every learner rank without waiting: the calls, in rank order (collect_learn)."""
    plans = plan_step(batches, len(cluster.learners), step, cluster.context_parallel, cluster.expert_parallel)
    return [lr.step.remote(p) for lr, p in zip(cluster.learners, plans, strict=True)]


def collect_learn(cluster: Cluster, futures: list, step: int) -> dict:
    """Wait for submit_learn's calls: the ranks' sums (loss, kl, clipped, tokens), maxima, the global gradient norm,
    whether the step was skipped (a non-finite gradient: nothing changed), and `learner_s`, the slowest rank's own
    seconds in the step."""
    per_rank = gather(futures, cluster, f"step {step}")
    # Under context parallel the first rank of each CP group reports its replica; its CP peers ran the same groups.
    replicas = [
        per_rank[ranks[0]] for ranks in cp_group_ranks(len(per_rank), cluster.context_parallel, cluster.expert_parallel)
    ]
    sums = {k: sum(r[k] for r in replicas) for k in ("loss", "kl", "clipped", "tokens")}
    sums.update({k: max(r[k] for r in per_rank) for k in ("peak_memory_mb", "logp_diff_max")})
    sums["learner_s"] = max(r["seconds"] for r in per_rank)
    sums["grad_norm"] = per_rank[0]["grad_norm"]  # already global: DeepSpeed reduces it across ranks
    sums["lr"] = per_rank[0]["lr"]
    sums["skipped"] = any(r["skipped"] for r in per_rank)
    sums["bad"] = any(r["bad"] for r in per_rank)
    trust = TrustCounts()
    for r in replicas:
        trust.add(r["trust"])
    sums.update(trust.metrics())
    return sums


def save_revision(config: Config, out: Path, store: Catalog, rev: Revision) -> Path:
    """Export the revision as a PEFT adapter directory in <run>/adapters/step_NNNNNN, then apply retention:
    `mint.keep_last` revisions of this run keep their tensors in the catalog (plus tagged and named ones; entries
    and lineage stay) and as adapter directories."""
    from mint.hub import export_peft

    target = out / "adapters" / f"step_{rev.step:06d}"
    if not target.exists():
        export_peft(store, rev.id, target)
    if config.mint.keep_last:
        store.gc(config.mint.keep_last, run=config.logging.name)
        kept = sorted((out / "adapters").glob("step_*"))
        for old in kept[: -config.mint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return target
