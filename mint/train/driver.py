"""The driver: one GRPO run, top to bottom.

    checks (before anything is touched) -> run directory -> Ray
    -> a session: reserve the layout -> check its nodes -> the rollout fleet and the learner group (mint.train.cluster)
       -> restore the latest checkpoint, or publish the initial revision
    -> per step: prompts -> rollout fleet (sample G, score rewards) -> group advantages
                 -> learner group (one optimizer step; a non-finite one is skipped, never published)
                 -> publish: admit (finite, hashed) -> broadcast to the rollout fleet -> catalog write (off the
                    critical path) -> log -> every checkpoint.every steps, a checkpoint
    -> final checkpoint and summary

The driver only asks: the learner group (mint.train.learner_group) and the rollout fleet (mint.train.rollout_fleet)
own their actors, restarts and recovery. With rollout.max_staleness = k >= 1 the rollouts of the next k steps are
already queued on the rollout actors while the learner trains, and the broadcast queues behind them
(mint.train.pipeline); when the pipeline has the next step's rollout in flight, its learning is queued on the learner
before this step's revision is published, so the learner never waits for the driver's publish, logging or eval.
With k = 0 each step waits for rollout, learning and the actors' loads in turn.

What survives what (docs/reliability.md): a dead rollout actor is restarted by Ray and redoes its shard; a dead
learner rank restarts the actors from the latest checkpoint (checkpoint.max_restarts times); a killed driver resumes
with `mint train RECIPE --resume`; Ctrl-C finishes the step in flight, checkpoints, and exits 130 (twice: at once).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.exceptions import RayActorError

from mint.config import Config, run_dir
from mint.errors import ConfigError, MintError
from mint.hub import Catalog, catalog_dir
from mint.rl.data import load_dataset
from mint.train import checkpoint, wire
from mint.train.checkpoint import RunState
from mint.train.cluster import Cluster, NodeLost, reserve, start_cluster, start_ray
from mint.train.evaluation import eval_set, evaluate, sample_rows
from mint.train.faults import Faults
from mint.train.learner_group import LearnerDied, LearnerGroup
from mint.train.metrics import RunLogger, truncate_step_logs
from mint.train.nodes import check_run_paths, driver_model_path
from mint.train.pipeline import RolloutPipeline
from mint.train.preflight import Preflight, preflight
from mint.train.step import CatalogWriter, Revision, RunCatalog, make_batches, save_revision
from mint.train.stops import bad_steps_message, check_kept

__all__ = ["prepare_run_dir", "summarize", "train"]


class Interrupt:
    """Ctrl-C: the first asks the run to stop after the step in flight (checkpointed, exit 130); a second one
    stops at once. Installed only in the main thread (signal handlers live there)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("mint: Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again stops now)", file=sys.stderr)


@dataclass
class Run:
    """What stays fixed across the learner group's restarts."""

    config: Config
    out: Path
    model_path: str
    init_lora: bytes | None
    interrupt: Interrupt
    t_start: float


def train(config: Config, resume: bool = False, checked: Preflight | None = None) -> dict:
    """Run GRPO for `config.grpo.steps` steps (continuing the run's latest checkpoint with `resume`). Returns the
    run summary, also written to <run>/summary.json. `checked`: the recipe's preflight, when the caller ran it."""
    t_start = time.time()
    if checked is None:
        preflight(config)  # every check that needs the recipe's inputs, before anything is written or started
    check_run_paths(config)  # no run dir in Ray's temporary job copy, no catalog on NFS (mint.train.nodes)
    model_path = driver_model_path(config.model.path)  # a tiny base built here, shipped to the nodes later
    out = open_run_dir(config, resume)
    init_lora = warm_start(config) if not resume else None
    local = None
    # A run that joined a cluster (ray.address) leaves it too: Ray's error listener would otherwise print the
    # cluster's late warnings (a lost node's retried calls) to stdout after the summary line.
    joined = not ray.is_initialized() and bool(config.ray.address)
    with Interrupt() as interrupt:
        try:
            local = start_ray(config)
            wire.register()  # the step's tensors cross Ray as numpy buffers (mint.train.wire)
            run = Run(config, out, model_path, init_lora, interrupt, t_start)
            return _with_restarts(run)
        finally:  # the processes this run started go with it: normal end, error or Ctrl-C
            if local is not None:
                local.stop()
            elif joined and ray.is_initialized():
                ray.shutdown()


def _with_restarts(run: Run) -> dict:
    """Sessions of actors; a dead learner rank or a lost node ends one, and the next starts from the latest
    checkpoint (on the nodes that are left: the layout is planned again)."""
    restarts = 0
    while True:
        try:
            return _session(run, restarts)
        except (LearnerDied, NodeLost) as err:
            latest = checkpoint.latest(run.out)
            where = f"the checkpoint {latest}" if latest else "the start (no checkpoint yet)"
            if restarts >= run.config.checkpoint.max_restarts:
                raise MintError(
                    f"{err}; gave up after {restarts} restart(s); resume from {where} with `mint train RECIPE --resume`"
                ) from None
            restarts += 1
            print(
                f"mint: {err}; restarting the actors from {where} ({restarts}/{run.config.checkpoint.max_restarts})",
                file=sys.stderr,
            )


def _session(run: Run, restarts: int) -> dict:
    """Start the actors, restore the latest checkpoint if there is one, and train to the end (or to Ctrl-C)."""
    config, out = run.config, run.out
    latest = checkpoint.latest(out)
    state = checkpoint.read(latest, config.result_digest()) if latest else RunState()
    state.restarts = max(state.restarts, restarts)
    truncate_step_logs(out, state.step)  # the steps after the checkpoint run again: their rows go
    cluster = _start_cluster(run, None if latest else run.init_lora)
    learners, fleet = cluster.learners, cluster.fleet
    store = Catalog(catalog_dir(config))
    logger = RunLogger(config, out, initial=state.step, faults=Faults.from_env())
    try:
        catalog = RunCatalog(store, config, run.model_path, learners.adapter_config(run.model_path))
        if latest:
            rev = Revision(state.revision, state.step, learners.restore(str(latest), state.revision))
            fleet.load(rev)  # each actor checks the restored bytes hash to the revision
        else:  # the initial revision: admit -> broadcast -> catalog write, as every step's (_steps)
            refs = learners.request_state()
            admitted = catalog.admit(0, None, learners.state(refs), refs[0])
            fleet.load(admitted.revision)
            catalog.write(admitted)
            rev = admitted.revision
            state.revision = rev.id
        rev = _steps(run, cluster, catalog, logger, state, rev)
        if state.step and (latest is None or state.step > int(latest.name.removeprefix("step_"))):
            save_checkpoint(learners, out, state, config)
        final_digests = learners.param_digests()
    except (MintError, RayActorError) as err:
        if cluster.lost and not isinstance(err, NodeLost):  # what broke is a symptom of the node that left
            raise NodeLost(cluster.lost) from err
        raise
    except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint of the step in flight, but a summary of the run
        summary = summarize(state.rewards, state.revision or "", time.time() - run.t_start)
        summary.update(run_dir=str(out), checkpoint=str(checkpoint.latest(out) or ""), interrupted=True)
        _write_json(out / "summary.json", summary)
        raise
    finally:
        logger.close()
        store.close()
        cluster.close()
    summary = summarize(state.rewards, rev.id, time.time() - run.t_start)
    summary.update(
        run_dir=str(out),
        adapter=str(out / "adapters" / f"step_{rev.step:06d}"),
        checkpoint=str(checkpoint.latest(out) or ""),
        base_digest=final_digests[0]["base"],
        lora_digest=final_digests[0]["lora"],
        skipped_steps=state.skipped_steps,
        reward_errors=state.reward_errors,
        restarts=state.restarts,
        interrupted=run.interrupt.requested and state.step < config.grpo.steps,
        **({f"{k}_first": v for k, v in state.eval_first.items()} if state.eval_first else {}),
        **({f"{k}_last": v for k, v in state.eval_last.items()} if state.eval_last else {}),
    )
    _write_json(out / "summary.json", summary)
    return summary


def _start_cluster(run: Run, init_lora: bytes | None) -> Cluster:
    """Reserve the layout on the alive nodes, then check every node it uses and start the actors there
    (mint.train.cluster)."""
    placement = reserve(run.config)
    try:
        return start_cluster(run.config, placement, run.model_path, init_lora, run.out)
    except BaseException:
        placement.release()
        raise


def _steps(run: Run, cluster: Cluster, catalog: RunCatalog, logger: RunLogger, state: RunState, rev: Revision):
    """The training loop from state.step + 1 to grpo.steps; returns the latest revision. With rollout.max_staleness
    = k, the rollouts of the next k steps run while the learner trains (mint.train.pipeline)."""
    config, out, learners, fleet = run.config, run.out, cluster.learners, cluster.fleet
    dataset = load_dataset(config.data.source, config.data.prompt_key, config.data.answer_key)
    stream = dataset.batches(config.rollout.prompts_per_step, config.grpo.seed, start=state.step)
    held_out = eval_set(config)
    if held_out and state.step == 0:  # a resumed run keeps the first eval its checkpoint holds
        state.eval_first = evaluate(fleet, held_out, config, 0, rev)
        logger.note(f"mint: eval before training: {_fmt(state.eval_first)}")
    pipe = RolloutPipeline(fleet, config, stream, rev, state.step)
    ahead: Begun | None = None  # the next step, begun before this one's publish (k >= 1)
    with CatalogWriter() as writer:  # each revision's catalog copy is written while the learner trains on the next
        while ahead is not None or (state.step < config.grpo.steps and not run.interrupt.requested):
            step = state.step + 1
            t0 = time.time()
            now, ahead = ahead or _begin(run, learners, state, logger, step, pipe.samples), None
            staleness = pipe.staleness(now.results)  # against the revision the learner holds before this update
            sums = learners.collect_learn(now.call, step) if now.call else {"skipped": False, "bad": False}
            times = dict(rollout_s=now.rollout_s, learn_s=sums.get("learner_s", 0.0))
            step_metrics = dict(
                reward_mean=float(now.rewards_B_G.mean()),
                **{k: v for k, v in sums.items() if k not in ("bad", "bad_cause", "learner_s")},
            )
            t_sync = time.time()
            skipped = sums["skipped"]
            refs = None if skipped else learners.request_state()
            t_begun = time.time()
            if not run.interrupt.requested and pipe.in_flight(step + 1):
                # The next step's rollout is in already: its learning queues on the learner right behind the state
                # request above, and runs while the driver publishes this step's revision.
                ahead = _begin(run, learners, state, logger, step + 1, pipe.collect)
                t_sync += time.time() - t_begun  # the next step's wait for samples is its rollout_s, not sync_s
            if skipped:  # nothing changed: nothing to publish
                state.skipped_steps += 1
                state.bad_steps = state.bad_steps + 1 if sums["bad"] else 0
            else:
                state.bad_steps = 0
                admitted = catalog.admit(step, rev, learners.state(refs), refs[0])  # finite, hashed: publishable
                if admitted.new:
                    pipe.broadcast(admitted.revision)  # to the rollout fleet: awaited at k = 0, queued at k >= 1
                writer.submit(catalog.write, admitted, now.results, step_metrics)  # off the critical path
                rev = admitted.revision
            pipe.queue_ahead()  # with a step begun ahead, the rollouts beyond it sample with this step's revision
            times["sync_s"] = time.time() - t_sync
            times["catalog_s"] = writer.seconds  # the latest catalog copy finished, off the critical path
            state.step, state.revision = step, rev.id
            state.rewards.append(step_metrics["reward_mean"])
            metrics = _metrics(config, step, now, sums, rev, state, fleet, t0, times)
            metrics.update(staleness)
            every = config.eval.every
            if held_out and ((every and step % every == 0) or step == config.grpo.steps):
                state.eval_last = evaluate(fleet, held_out, config, step, rev)
                metrics.update(state.eval_last)
                logger.note(f"mint: step {step}: eval {_fmt(state.eval_last)}")
            if config.logging.samples_every and step % config.logging.samples_every == 0:
                logger.samples(sample_rows(config, step, now.results, now.rewards_B_G))
            logger.log(metrics)
            if state.bad_steps >= config.checkpoint.max_bad_steps:
                latest = checkpoint.latest(out)
                raise MintError(bad_steps_message(config, state.bad_steps, sums.get("bad_cause"), latest))
            check_kept(config, state, step, sums)  # a run whose trust mask drops (nearly) every token stops here
            if step % config.catalog.export_every == 0 or step == config.grpo.steps:
                writer.wait()  # the export reads the catalog copy
                save_revision(config, out, catalog.store, rev)
            if config.checkpoint.every and step % config.checkpoint.every == 0 and step < config.grpo.steps:
                writer.wait()  # a checkpoint names a revision the catalog must hold
                save_checkpoint(learners, out, state, config)  # never with a step begun ahead (the pipeline drains)
    return rev


@dataclass
class Begun:
    """A step whose samples are in and whose learning is queued on the learner ranks (`call`; None: no group was
    kept, nothing to learn)."""

    results: list
    batches: list
    rewards_B_G: object  # torch.Tensor [B, G]
    call: list | None
    rollout_s: float  # how long the driver waited for the samples


def _begin(
    run: Run, learners: LearnerGroup, state: RunState, logger: RunLogger, step: int, samples: Callable[[int], list]
) -> Begun:
    """Wait for step `step`'s samples (`samples`: the pipeline's `samples` in the step's own turn, which first
    queues the rollouts its bound allows; its `collect` when begun ahead, during the step before), check its rewards,
    and queue its learning on the learner ranks."""
    t0 = time.time()
    results = samples(step)
    rollout_s = time.time() - t0
    _check_rewards(run.config, step, results, state, logger)
    batches, rewards_B_G = make_batches(run.config, results)
    call = learners.submit_learn(batches, step) if batches else None
    return Begun(results, batches, rewards_B_G, call, rollout_s)


def _fmt(metrics: dict) -> str:
    return ", ".join(f"{k.removeprefix('eval_')} {v:.3f}" for k, v in metrics.items())


def _check_rewards(config: Config, step: int, results: list, state: RunState, logger: RunLogger) -> None:
    """Reward errors are loud: the first in full, then a count per step; too many stop the run."""
    errors = sum(r.reward_errors for r in results)
    if not errors:
        return
    samples = sum(len(r.rewards_G) for r in results)
    first = next(r.reward_error for r in results if r.reward_errors)
    if state.reward_errors == 0:
        logger.note(f"mint: step {step}: the reward function raised on {errors} of {samples} samples; first: {first}")
    else:
        logger.note(f"mint: step {step}: reward errors on {errors} of {samples} samples (scored 0)")
    state.reward_errors += errors
    if errors / samples > config.data.max_reward_error_frac:
        raise MintError(
            f"reward {config.data.reward!r} raised on {errors} of {samples} samples at step {step} "
            f"(data.max_reward_error_frac = {config.data.max_reward_error_frac}); first: {first}"
        )


def _metrics(config, step, now: Begun, sums, rev, state, fleet, t0, times) -> dict:
    """The step's metrics. Time: rollout_s waited for the step's samples (the whole rollout when on-policy, only what
    learning did not hide with rollout.max_staleness >= 1), learn_s the slowest learner rank's own seconds in the
    optimizer step, sync_s publishing the revision to the rollout actors, step_s the loop's seconds for the step,
    and idle_s = step_s - learn_s the learner group's idle time."""
    results, groups_kept, rewards_B_G = now.results, len(now.batches), now.rewards_B_G
    tokens = max(sums.get("tokens", 0.0), 1.0)
    gen_tokens = sum(len(c.tokens_R) for r in results for c in r.rollout.completions)
    step_s = time.time() - t0
    return dict(
        step=step,
        reward_mean=float(rewards_B_G.mean()),
        reward_std=float(rewards_B_G.std(unbiased=False)),
        reward_errors=sum(r.reward_errors for r in results),
        groups_kept=groups_kept,
        loss=sums.get("loss", 0.0),
        kl=sums.get("kl", 0.0) / tokens,
        clip_frac=sums.get("clipped", 0.0) / tokens,
        grad_norm=sums.get("grad_norm", 0.0),
        lr=sums.get("lr", 0.0),
        skipped=int(sums["skipped"]),
        skipped_steps=state.skipped_steps,
        restarts=state.restarts,
        rollout_restarts=fleet.restarts,
        engine_restarts=fleet.engine_restarts,
        logp_diff_max=sums.get("logp_diff_max", 0.0),
        response_tokens=gen_tokens,
        response_len_mean=gen_tokens / rewards_B_G.numel(),
        tokens_per_s=gen_tokens / max(step_s, 1e-9),
        **times,
        idle_s=max(step_s - times["learn_s"], 0.0),  # 0 when the step was begun during the one before
        step_s=step_s,
        peak_memory_mb=sums.get("peak_memory_mb", 0.0),
        revision=rev.id,
        **_reward_parts(results),
        **_episode_metrics(results),
        **{k: v for k, v in sums.items() if k.startswith(("masked_", "trust_", "out_of_route", "mismatch"))},
    )


def _episode_metrics(results: list) -> dict[str, float]:
    """Multi-turn runs (env.name): turns and tokens per episode, the fraction that ended for each stop reason, the
    masked actions, and each environment metric's mean per episode (env/<name>)."""
    episodes = [ep for r in results for ep in (r.episodes or [])]
    if not episodes:
        return {}
    n = len(episodes)
    out = {
        "turns_mean": sum(len(ep["turns"]) for ep in episodes) / n,
        "episode_tokens_mean": sum(ep["tokens"] for ep in episodes) / n,
        "masked_turns": float(sum(t["masked"] for ep in episodes for t in ep["turns"])),
    }
    for reason in sorted({ep["stop_reason"] for ep in episodes}):
        out[f"stop/{reason}"] = sum(ep["stop_reason"] == reason for ep in episodes) / n
    for name in sorted({k for ep in episodes for k in ep["metrics"]}):
        out[f"env/{name}"] = sum(ep["metrics"].get(name, 0.0) for ep in episodes) / n
    return out


def _reward_parts(results: list) -> dict[str, float]:
    """reward/<name>: each reward function's mean over the step, when the reward is a weighted sum of several."""
    parts = [r.rewards_by_fn for r in results if r.rewards_by_fn]
    if not parts or len(parts[0]) < 2:
        return {}
    return {f"reward/{name}": sum(sum(p[name]) for p in parts) / sum(len(p[name]) for p in parts) for name in parts[0]}


def save_checkpoint(learners: LearnerGroup, out: Path, state: RunState, config: Config) -> Path:
    """Every rank writes its part into a .partial directory, then the driver commits it (mint.train.checkpoint)."""
    partial = checkpoint.begin(out, state.step)
    learners.save_checkpoint(str(partial))
    return checkpoint.commit(partial, state, config.result_digest(), config.checkpoint.keep_last)


def warm_start(config: Config) -> bytes | None:
    """lora.init: the LoRA tensors a new run starts from (hash-verified), as safetensors bytes; None without one."""
    ref = config.lora.init
    if not ref:
        return None
    from mint.hub import read_revision_dir, to_bytes

    if Path(ref).is_dir():
        tensors, _, _ = read_revision_dir(Path(ref))
        return to_bytes(tensors)
    with Catalog(catalog_dir(config), create=False) as store:
        tensors, _ = store.load(ref)
    return to_bytes(tensors)


def open_run_dir(config: Config, resume: bool) -> Path:
    """A fresh run directory, or with `resume` the existing one, which must hold a complete checkpoint."""
    if not resume:
        return prepare_run_dir(config)
    out = run_dir(config).absolute()  # absolute: learner ranks on other nodes write checkpoint parts into it
    latest = checkpoint.latest(out)
    if latest is None:
        raise ConfigError(f"--resume: {out} has no complete checkpoint to resume from (checkpoint.every)")
    checkpoint.read(latest, config.result_digest())  # refuses a recipe that computes something else
    _write_json(out / "config.json", config.to_dict())
    return out


def prepare_run_dir(config: Config) -> Path:
    """A fresh run directory. An earlier run under the same name is moved aside, never overwritten or mixed in."""
    out = run_dir(config).absolute()
    if out.exists() and any(out.iterdir()):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(out.stat().st_mtime))
        moved = out.with_name(f"{out.name}.{stamp}")
        n = 1
        while moved.exists():
            moved, n = out.with_name(f"{out.name}.{stamp}-{n}"), n + 1
        out.rename(moved)
        print(f"mint: moved the previous run in {out} to {moved}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config.to_dict())
    return out


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    tmp.replace(path)


def summarize(rewards_per_step: list[float], revision: str, seconds: float) -> dict:
    """reward_first / reward_last: mean step reward over the first and last 10% of steps (at least one step)."""
    k = max(1, round(0.1 * len(rewards_per_step)))
    first = sum(rewards_per_step[:k]) / k if rewards_per_step else 0.0
    last = sum(rewards_per_step[-k:]) / k if rewards_per_step else 0.0
    return dict(
        steps=len(rewards_per_step),
        reward_first=round(first, 4),
        reward_last=round(last, 4),
        reward_gain=round(last - first, 4),
        revision=revision,
        seconds=round(seconds, 1),
    )
