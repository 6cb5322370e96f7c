"""The driver: one GRPO run, top to bottom.

    prompts -> RolloutActors (sample G, score rewards) -> group advantages -> LearnerActors (one optimizer step)
            -> publish the new adapter revision -> RolloutActors hot-load it -> log

Weight sync *is* revision publish: each step's LoRA tensors become a revision in the catalog (<run>/catalog by
default, with lineage and the step's rollout records), travel as safetensors bytes with their id through the Ray
object store, and every `save_every` steps are also exported to <run>/adapters as a PEFT adapter directory.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from longstraw.trust import TrustCounts
from mint.config import Config, run_dir
from mint.hub import Catalog, catalog_dir, from_bytes
from mint.models.tiny import resolve_model_path
from mint.rl.data import load_dataset
from mint.rl.grpo import group_advantages_batch, zero_variance_mask
from mint.train.learner import GroupBatch, LearnerActor, MicroStep, StepPlan
from mint.train.metrics import RunLogger
from mint.train.rollout_actor import GroupResult, RolloutActor


@dataclass
class Cluster:
    """The actors of one run and the placement group that holds them."""

    learners: list
    rollouts: list
    pg: object
    started_ray: bool

    def close(self) -> None:
        for actor in self.learners + self.rollouts:
            ray.kill(actor)
        remove_placement_group(self.pg)
        if self.started_ray:
            ray.shutdown()


@dataclass
class Revision:
    id: str
    step: int
    data: bytes = field(repr=False)
    parent: str | None = None


def start_cluster(config: Config, model_path: str) -> Cluster:
    """Start (or join) Ray, reserve one bundle per actor, create the actors and wire the learner's process group."""
    r = config.ray
    started = False
    if not ray.is_initialized():
        n_bundles = config.learner.num_ranks * r.learner_cpus + config.rollout.num_actors * r.rollout_cpus
        # A local cluster gets at least one logical CPU per bundle: tiny actors share 2 cores fine.
        local_cpus = max(os.cpu_count() or 1, math.ceil(n_bundles))
        kwargs = dict(address=r.address) if r.address else dict(num_cpus=local_cpus)
        # Actor logs stay in Ray's session folder: the driver's stdout ends with one JSON line, nothing after it.
        ray.init(include_dashboard=False, log_to_driver=False, **kwargs)
        started = True
    learner_bundle = {"CPU": r.learner_cpus, **({"GPU": r.learner_gpus} if r.learner_gpus else {})}
    rollout_bundle = {"CPU": r.rollout_cpus, **({"GPU": r.rollout_gpus} if r.rollout_gpus else {})}
    bundles = [learner_bundle] * config.learner.num_ranks + [rollout_bundle] * config.rollout.num_actors
    pg = placement_group(bundles, strategy=r.placement)
    ray.get(pg.ready())

    def on(i: int, resources: dict):
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
        return dict(num_cpus=resources["CPU"], num_gpus=resources.get("GPU", 0), scheduling_strategy=strategy)

    # The actor classes stay plain classes (importable, so Ray pickles their methods by reference) and become
    # actors here.
    n = config.learner.num_ranks
    learner_cls, rollout_cls = ray.remote(LearnerActor), ray.remote(RolloutActor)
    learners = [learner_cls.options(**on(i, learner_bundle)).remote(config, model_path, i, n) for i in range(n)]
    rollouts = [
        rollout_cls.options(**on(n + j, rollout_bundle)).remote(config, model_path)
        for j in range(config.rollout.num_actors)
    ]
    addr, port = ray.get(learners[0].address.remote())
    ray.get([learner.setup.remote(addr, port) for learner in learners])
    return Cluster(learners, rollouts, pg, started)


@functools.lru_cache(maxsize=8)
def _fingerprint(model_path: str) -> str:
    """The base's fingerprint, read from its files once per run, not every step (up to 128 MiB of reads)."""
    from mint.hub import base_fingerprint

    return base_fingerprint(model_path)


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
) -> Revision:
    """Publish the learner's LoRA state as a catalog revision and hot-load it into every rollout actor by id.

    The step's rollout records (sampled with `parent`) are stored beside it. Weight sync *is* this publish: the
    actors receive the id with the safetensors bytes and refuse bytes that do not hash to it. An update that left
    the adapter unchanged (same id as the parent) publishes nothing new and returns the parent.
    """
    from mint.hub import write_step

    data = ray.get([learner.lora_state_bytes.remote() for learner in cluster.learners])[0]
    tensors = from_bytes(data)
    run = config.logging.name
    if results and parent is not None:
        write_step(store, run, step, parent.id, results, config.mint.rollout_records)
    meta = store.put(  # returns the existing entry, writing nothing, for tensors already in the catalog
        tensors,
        adapter_config,
        run=run,
        step=step,
        parent=parent.id if parent is not None else None,
        recipe_hash=config.digest(),
        base_model=config.model.path,
        base_fingerprint=_fingerprint(model_path),
        metrics=metrics or {},
    )
    if parent is not None and meta.id == parent.id:
        return parent
    ref = ray.put(data)
    ray.get([actor.load_adapter.remote(meta.id, ref) for actor in cluster.rollouts])
    return Revision(meta.id, step, data, parent.id if parent is not None else None)


def run_rollouts(cluster: Cluster, examples: list, seed: int) -> list[GroupResult]:
    """Spread the step's prompts over the rollout actors; each group stays on one actor (shared prefix)."""
    n = len(cluster.rollouts)
    shards = [examples[i::n] for i in range(n)]
    pairs = zip(cluster.rollouts, shards, strict=True)
    futures = [actor.rollout.remote(shard, seed * 1000 + i) for i, (actor, shard) in enumerate(pairs) if shard]
    return [g for shard in ray.get(futures) for g in shard]


def plan_step(groups: list[GroupBatch], world_size: int) -> list[StepPlan]:
    """Assign groups to ranks (fewest tokens first) and pad every rank to the same number of micro-steps."""
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


def save_revision(config: Config, out: Path, store: Catalog, rev: Revision) -> Path:
    """Export the revision as a PEFT adapter directory in <run>/adapters/step_NNNNNN (hard-linked to the catalog's
    tensors where the filesystem allows), then apply retention: `mint.keep_last` revisions of this run keep their
    tensors in the catalog (plus tagged and named ones; entries and lineage stay) and as adapter directories."""
    from mint.hub import export_peft

    target = out / "adapters" / f"step_{rev.step:06d}"
    if not target.exists():
        export_peft(store, rev.id, target, link=True)
    if config.mint.keep_last:
        store.gc(config.mint.keep_last, run=config.logging.name)
        kept = sorted((out / "adapters").glob("step_*"))
        for old in kept[: -config.mint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def prepare_run_dir(config: Config) -> Path:
    """A fresh run directory. An earlier run under the same name is moved aside, never overwritten or mixed in."""
    out = run_dir(config)
    if out.exists() and any(out.iterdir()):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(out.stat().st_mtime))
        moved = out.with_name(f"{out.name}.{stamp}")
        n = 1
        while moved.exists():
            moved, n = out.with_name(f"{out.name}.{stamp}-{n}"), n + 1
        out.rename(moved)
        print(f"mint: moved the previous run in {out} to {moved}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True))
    return out


def make_batches(config: Config, results: list[GroupResult]) -> tuple[list[GroupBatch], torch.Tensor]:
    """Group-relative advantages, then the learner's batches (zero-variance groups dropped when asked)."""
    rewards_B_G = torch.tensor([r.rewards_G for r in results], dtype=torch.float32)
    adv_B_G = group_advantages_batch(rewards_B_G, scale_std=config.grpo.scale_std)
    batches = to_batches(results, adv_B_G)
    if config.grpo.filter_zero_variance:
        batches = [b for b, keep in zip(batches, zero_variance_mask(rewards_B_G).tolist(), strict=True) if keep]
    return batches, rewards_B_G


def learn(cluster: Cluster, batches: list[GroupBatch]) -> dict:
    """One optimizer step over the learner group; returns the ranks' sums (loss, kl, clipped, tokens) and maxima."""
    plans = plan_step(batches, len(cluster.learners))
    per_rank = ray.get([lr.step.remote(p) for lr, p in zip(cluster.learners, plans, strict=True)])
    sums = {k: sum(r[k] for r in per_rank) for k in ("loss", "kl", "clipped", "tokens")}
    sums.update({k: max(r[k] for r in per_rank) for k in ("peak_memory_mb", "logp_diff_max")})
    sums["grad_norm"] = per_rank[0]["grad_norm"]  # already global: DeepSpeed reduces it across ranks
    trust = TrustCounts()
    for r in per_rank:
        trust.add(r["trust"])
    sums.update(trust.metrics())
    return sums


def train(config: Config) -> dict:
    """Run GRPO for `config.grpo.steps` steps. Returns the run summary (also written to <run>/summary.json)."""
    t_start = time.time()
    out = prepare_run_dir(config)
    model_path = resolve_model_path(config.model.path)
    dataset = load_dataset(config.data.source, config.data.prompt_key, config.data.answer_key)
    stream = dataset.batches(config.rollout.prompts_per_step, config.grpo.seed)
    cluster = start_cluster(config, model_path)
    logger = RunLogger(config, out)
    store = Catalog(catalog_dir(config))
    try:
        adapter_config = ray.get(cluster.learners[0].adapter_config.remote(model_path))
        rev = publish(cluster, store, config, model_path, adapter_config, 0, None)
        rewards_per_step: list[float] = []
        for step in range(1, config.grpo.steps + 1):
            t0 = time.time()
            results = run_rollouts(cluster, next(stream), config.grpo.seed + step)
            t_rollout = time.time() - t0
            batches, rewards_B_G = make_batches(config, results)
            sums = learn(cluster, batches) if batches else {}
            step_metrics = dict(reward_mean=float(rewards_B_G.mean()), **sums)
            rev = publish(cluster, store, config, model_path, adapter_config, step, rev, results, step_metrics)
            tokens = max(sums.get("tokens", 0.0), 1.0)
            gen_tokens = sum(len(c.tokens_R) for r in results for c in r.rollout.completions)
            step_s = time.time() - t0
            metrics = dict(
                step=step,
                reward_mean=float(rewards_B_G.mean()),
                reward_std=float(rewards_B_G.std(unbiased=False)),
                reward_errors=sum(r.reward_errors for r in results),
                groups_kept=len(batches),
                loss=sums.get("loss", 0.0),
                kl=sums.get("kl", 0.0) / tokens,
                clip_frac=sums.get("clipped", 0.0) / tokens,
                grad_norm=sums.get("grad_norm", 0.0),
                logp_diff_max=sums.get("logp_diff_max", 0.0),
                response_tokens=gen_tokens,
                response_len_mean=gen_tokens / rewards_B_G.numel(),
                tokens_per_s=gen_tokens / max(step_s, 1e-9),
                rollout_s=t_rollout,
                learn_s=step_s - t_rollout,
                step_s=step_s,
                peak_memory_mb=sums.get("peak_memory_mb", 0.0),
                revision=rev.id,
                **{k: v for k, v in sums.items() if k.startswith(("masked_", "trust_", "out_of_route", "mismatch"))},
            )
            if step % config.mint.save_every == 0 or step == config.grpo.steps:
                save_revision(config, out, store, rev)
            rewards_per_step.append(metrics["reward_mean"])
            logger.log(metrics)
        final_digests = ray.get([lr.param_digests.remote() for lr in cluster.learners])
    finally:
        logger.close()
        store.close()
        cluster.close()
    summary = summarize(rewards_per_step, rev.id, time.time() - t_start)
    summary.update(
        run_dir=str(out),
        adapter=str(out / "adapters" / f"step_{rev.step:06d}"),
        base_digest=final_digests[0]["base"],
        lora_digest=final_digests[0]["lora"],
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def summarize(rewards_per_step: list[float], revision: str, seconds: float) -> dict:
    """reward_first / reward_last: mean step reward over the first and last 10% of steps (at least one step)."""
    k = max(1, round(0.1 * len(rewards_per_step)))
    first = sum(rewards_per_step[:k]) / k
    last = sum(rewards_per_step[-k:]) / k
    return dict(
        steps=len(rewards_per_step),
        reward_first=round(first, 4),
        reward_last=round(last, 4),
        reward_gain=round(last - first, 4),
        revision=revision,
        seconds=round(seconds, 1),
    )
