"""The actors of one run: where they are placed, how calls to them are gathered, and what happens when one dies.

- Rollout actors hold nothing but the current revision. Ray restarts a dead one (`rollout.max_restarts`); the driver
  hands it the current revision again (hash checked there) and retries its shard of the step.
- Learner ranks share one torch.distributed group, so one dead rank breaks the others' collectives. A dead rank fails
  the step at once (`LearnerDied`, without waiting on the survivors, which may be blocked in a collective); the
  driver then tears the actors down and restarts them from the latest checkpoint (mint.train.driver).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mint.config import Config
from mint.errors import MintError
from mint.train.faults import Faults
from mint.train.learner import LearnerActor
from mint.train.rollout_actor import RolloutActor, StaleRevision

ACTOR_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
# How long the driver waits for Ray to bring a dead rollout actor back (it reloads its model: seconds on CPU).
RESTART_WAIT_S = 300.0


class LearnerDied(MintError):
    """A learner rank died during a call; the group cannot go on without a restart."""


@dataclass
class Cluster:
    """The actors of one run and the placement group that holds them."""

    learners: list
    rollouts: list
    pg: object
    started_ray: bool
    where: dict[str, str] = field(default_factory=dict)  # "learner rank 1" -> "pid 123 on 10.0.0.2"
    rollout_restarts: int = 0  # rollout actors Ray restarted, seen as a new process id behind the same handle
    rollout_pids: list[int] = field(default_factory=list)

    def close(self, shutdown: bool = True) -> None:
        """Kill the actors and free the placement group; with `shutdown`, stop a Ray this run started."""
        for actor in self.learners + self.rollouts:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.pg)
        if shutdown and self.started_ray:
            ray.shutdown()


def start_ray(config: Config) -> bool:
    """Join `ray.address`, or start a local Ray sized for the run's bundles; True when this run started it."""
    if ray.is_initialized():
        return False
    r = config.ray
    n_bundles = config.learner.num_ranks * r.learner_cpus + config.rollout.num_actors * r.rollout_cpus
    # A local cluster gets at least one logical CPU per bundle: tiny actors share 2 cores fine.
    local_cpus = max(os.cpu_count() or 1, math.ceil(n_bundles))
    kwargs = dict(address=r.address) if r.address else dict(num_cpus=local_cpus)
    # Actor logs stay in Ray's session folder: the driver's stdout ends with one JSON line, nothing after it.
    ray.init(include_dashboard=False, log_to_driver=False, **kwargs)
    return not r.address


def start_cluster(config: Config, model_path: str, started_ray: bool, init_lora: bytes | None = None) -> Cluster:
    """Reserve one bundle per actor, create the actors and wire the learner's process group."""
    r = config.ray
    learner_bundle = {"CPU": r.learner_cpus, **({"GPU": r.learner_gpus} if r.learner_gpus else {})}
    rollout_bundle = {"CPU": r.rollout_cpus, **({"GPU": r.rollout_gpus} if r.rollout_gpus else {})}
    bundles = [learner_bundle] * config.learner.num_ranks + [rollout_bundle] * config.rollout.num_actors
    pg = placement_group(bundles, strategy=r.placement)
    ray.get(pg.ready())

    def on(i: int, resources: dict):
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
        return dict(num_cpus=resources["CPU"], num_gpus=resources.get("GPU", 0), scheduling_strategy=strategy)

    # The actor classes stay plain classes (importable, so Ray pickles their methods by reference) and become
    # actors here. Learners never restart on their own: a restarted rank could not rejoin the old process group.
    n, faults = config.learner.num_ranks, Faults.from_env()
    learner_cls = ray.remote(LearnerActor)
    # max_task_retries=-1: a call caught by a restart is rerun on the restarted actor (a rollout then refuses with
    # StaleRevision until the driver has loaded the current revision into it again).
    restarts = config.rollout.max_restarts
    rollout_cls = ray.remote(max_restarts=restarts, max_task_retries=-1 if restarts else 0)(RolloutActor)
    learners = [learner_cls.options(**on(i, learner_bundle)).remote(config, model_path, i, n, faults) for i in range(n)]
    rollouts = [
        rollout_cls.options(**on(n + j, rollout_bundle)).remote(config, model_path)
        for j in range(config.rollout.num_actors)
    ]
    cluster = Cluster(learners, rollouts, pg, started_ray)
    try:
        addr, port = ray.get(learners[0].address.remote())
        gather([lr.setup.remote(addr, port, init_lora) for lr in learners], cluster, "setup")
        names = [f"learner rank {i}" for i in range(n)] + [f"rollout actor {j}" for j in range(len(rollouts))]
        places = ray.get([a.where.remote() for a in learners + rollouts])
        cluster.where = dict(zip(names, places, strict=True))
        cluster.rollout_pids = ray.get([a.pid.remote() for a in rollouts])
    except BaseException:
        cluster.close(shutdown=False)
        raise
    return cluster


def gather(futures: list, cluster: Cluster, what: str) -> list:
    """ray.get of one call per learner rank, in rank order, failing as soon as any rank has died.

    A plain ray.get(list) would wait on rank 0 while rank 1 is already dead and rank 0 blocks in a collective that
    can never complete (gloo's default timeout is 30 minutes).
    """
    index = {f: i for i, f in enumerate(futures)}
    results: list = [None] * len(futures)
    pending = list(futures)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        i = index[done[0]]
        try:
            results[i] = ray.get(done[0])
        except ACTOR_GONE as err:
            place = cluster.where.get(f"learner rank {i}", "")
            raise LearnerDied(f"learner rank {i} {place} died during {what}".replace("  ", " ")) from err
    return results


def load_revision(cluster: Cluster, rev_id: str, data_ref) -> None:
    """Hot-load a revision into every rollout actor (each checks the bytes hash to the id). An actor that died is
    loaded again once Ray has restarted it."""
    futures = [actor.load_adapter.remote(rev_id, data_ref) for actor in cluster.rollouts]
    for i, future in enumerate(futures):
        try:
            ray.get(future)
        except ACTOR_GONE:
            _reload(cluster, i, rev_id, data_ref)
    _count_restarts(cluster)


def _count_restarts(cluster: Cluster) -> None:
    """Ray may restart a dead actor and retry a call on it without the driver seeing an error (a load caught by the
    restart): count restarts by the actors' process ids instead."""
    pids = ray.get([actor.pid.remote() for actor in cluster.rollouts])
    cluster.rollout_restarts += sum(a != b for a, b in zip(pids, cluster.rollout_pids, strict=True))
    cluster.rollout_pids = pids


def _reload(cluster: Cluster, i: int, rev_id: str, data_ref) -> None:
    """Load the current revision into rollout actor i after Ray restarted it; one line when it is out of restarts."""
    deadline = time.monotonic() + RESTART_WAIT_S
    while True:
        try:  # retried by Ray once the actor is back; raises when it is out of restarts
            ray.get(cluster.rollouts[i].load_adapter.remote(rev_id, data_ref))
            return
        except ACTOR_GONE as err:
            if time.monotonic() > deadline:
                place = cluster.where.get(f"rollout actor {i}", "")
                raise MintError(f"rollout actor {i} {place} died and did not come back".replace("  ", " ")) from err
            time.sleep(1.0)


def rollout(cluster: Cluster, examples: list, seed: int, rev_id: str, data_ref) -> list:
    """Spread the step's prompts over the rollout actors (each group stays on one actor: shared prefix).

    A shard whose actor died (or was restarted by Ray since the last load, so holds the initial adapter) is retried
    once the actor holds the current revision again; an actor out of restarts ends the run with one line.
    """
    n = len(cluster.rollouts)
    shards = [examples[i::n] for i in range(n)]
    results: list[list] = [[] for _ in range(n)]
    for attempt in range(2):
        todo = [i for i in range(n) if shards[i] and not results[i]]
        futures = {i: cluster.rollouts[i].rollout.remote(shards[i], seed * 1000 + i, rev_id) for i in todo}
        dead = []
        for i, future in futures.items():
            try:
                results[i] = ray.get(future)
            except (*ACTOR_GONE, StaleRevision):
                dead.append(i)
        if not dead:
            break
        if attempt == 1:
            raise MintError(f"rollout actor {dead[0]} died again after a restart; stopping")
        for i in dead:
            _reload(cluster, i, rev_id, data_ref)
    _count_restarts(cluster)
    return [group for shard in results for group in shard]
