"""The actors of one run: where they are placed, how calls to them are gathered, and what happens when one dies.

- Rollout actors hold nothing but the current revision. Ray restarts a dead one (`rollout.max_restarts`); the driver
  hands it the current revision again (hash checked there) and retries its shard of the step.
- Learner ranks share one torch.distributed group, so one dead rank breaks the others' collectives. A dead rank fails
  the step at once (`LearnerDied`, without waiting on the survivors, which may be blocked in a collective); the
  driver then tears the actors down and restarts them from the latest checkpoint (mint.train.driver).
- Placement follows mint.train.placement (per-node bundles), and every node is checked before an actor starts
  (mint.train.nodes): the model it will load, and the run directory for learner nodes. A watchdog thread notices a
  node that leaves the cluster with actors on it, kills those actors (Ray would wait to restart them on a node that
  is gone) and marks the cluster lost; the driver then restarts the actors from the latest checkpoint on the nodes
  that are left (`NodeLost`, the same rule as a dead learner rank), or stops with one line when they cannot hold
  the layout.
- `rollout.engines = N`: the engine servers start before the rollout actors (mint.train.engines), which see their
  URLs as rollout.urls; `close` stops them. A failed rollout or sync asks them (`revive_engines`): a dead one is
  restarted (rollout.engine_restarts), the actors fronting it load their revision on it again, and the work is
  redone; past its restarts, one line names it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mint.config import Config
from mint.errors import MintError
from mint.rollout.backends import EngineError
from mint.train.engines import check_engines, revive_engines, start_engines, stop_engines
from mint.train.faults import Faults
from mint.train.learner import LearnerActor
from mint.train.nodes import connect, prepare_nodes
from mint.train.placement import Layout, cluster_nodes, node_name, plan_layout
from mint.train.rollout_actor import RolloutActor, StaleRevision

ACTOR_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
# How long the driver waits for Ray to bring a dead rollout actor back (it reloads its model: seconds on CPU).
RESTART_WAIT_S = 300.0
# How long the placement group may take to be reserved: the layout was planned on free nodes, so longer means
# another job holds their resources.
PLACEMENT_WAIT_S = 120.0
# How often the watchdog asks the GCS which nodes are alive (one small RPC).
NODE_POLL_S = 1.0


class LearnerDied(MintError):
    """A learner rank died during a call; the group cannot go on without a restart."""


class NodeLost(MintError):
    """A node left the cluster with actors of this run on it; they restart from the latest checkpoint elsewhere."""


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
    layout: Layout | None = None
    nodes: dict[str, str] = field(default_factory=dict)  # actor name -> the id of the node it runs on
    lost: str = ""  # set by the watchdog: which node left, with which actors
    engines: list = field(default_factory=list)  # EngineServer actors (rollout.engines), stopped by close()
    engine_restarts: int = 0  # engine servers restarted after they died (mint.train.engines.revive_engines)
    context_parallel: int = 1  # longstraw.context_parallel, learner.expert_parallel: how plans map to ranks
    expert_parallel: int = 1
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    def close(self, shutdown: bool = True) -> None:
        """Kill the actors and free the placement group; with `shutdown`, stop a Ray this run started."""
        self._stop.set()
        for actor in self.learners + self.rollouts:
            ray.kill(actor, no_restart=True)
        stop_engines(self.engines)  # each server's whole process group; never raises
        remove_placement_group(self.pg)
        if shutdown and self.started_ray:
            ray.shutdown()


def start_ray(config: Config) -> bool:
    """Join `ray.address`, or start a local Ray sized for the run's bundles; True when this run started it."""
    if ray.is_initialized():
        return False
    r = config.ray
    if r.address:
        connect(r.address)
        return False
    n_bundles = config.learner.num_ranks * r.learner_cpus + config.rollout.num_actors * r.rollout_cpus
    # A local cluster gets at least one logical CPU per bundle: tiny actors share 2 cores fine.
    local_cpus = max(os.cpu_count() or 1, math.ceil(n_bundles))
    # Actor logs stay in Ray's session folder: the driver's stdout ends with one JSON line, nothing after it.
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=local_cpus)
    return True


def start_cluster(
    config: Config, model_path: str, started_ray: bool, init_lora: bytes | None = None, run_dir=None
) -> Cluster:
    """Plan the layout on the alive nodes, reserve it, check every node it uses (mint.train.nodes), then create the
    actors, each loading the model from its own node's path, and wire the learner's process group. `run_dir`: where
    placement.json goes, and what learner nodes must see."""
    layout = plan_layout(config, cluster_nodes())
    selectors = {"bundle_label_selector": list(layout.selectors)} if layout.selectors else {}
    pg = placement_group(list(layout.bundles), strategy=layout.strategy, **selectors)
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_WAIT_S)
    except GetTimeoutError:
        remove_placement_group(pg)
        raise MintError(
            f"placement: the cluster did not grant the layout's bundles within {PLACEMENT_WAIT_S:g} s "
            f"({', '.join(map(str, layout.bundles))}); another job may hold those nodes' CPUs or GPUs"
        ) from None
    try:
        bundle_node = placement_group_table(pg)["bundles_to_node_id"]
        node_of = {s.actor: bundle_node[s.bundle] for s in layout.slots}
        names = {n["NodeID"]: f"{node_name(n)} ({n['NodeID'][:8]})" for n in ray.nodes()}
        learner_nodes = {node_of[s.actor] for s in layout.learners}
        # Before any actor: every node must hold the model (a tiny base is shipped) and, for learner nodes, see
        # the run directory. One line naming the node when not.
        paths = prepare_nodes(config, model_path, {n: names[n] for n in set(node_of.values())}, learner_nodes, run_dir)
        # rollout.engines: start the servers (mint.train.engines); the rollout actors then see their URLs as
        # rollout.urls, exactly as servers that already run.
        engines, rollout_config = [], config
        if config.rollout.engines:
            engines, urls = start_engines(config, model_path, run_dir)
            rollout_config = dataclasses.replace(
                config, rollout=dataclasses.replace(config.rollout, engines=0, urls=list(urls))
            )
    except BaseException:
        remove_placement_group(pg)
        raise
    cluster = Cluster([], [], pg, started_ray, layout=layout, nodes=node_of, engines=engines)
    cluster.context_parallel = config.longstraw.context_parallel
    cluster.expert_parallel = config.learner.expert_parallel

    def on(slot):
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=slot.bundle)
        return dict(num_cpus=slot.cpus, num_gpus=slot.gpus, scheduling_strategy=strategy)

    # The actor classes stay plain classes (importable, so Ray pickles their methods by reference) and become
    # actors here. Learners never restart on their own: a restarted rank could not rejoin the old process group.
    n, faults = config.learner.num_ranks, Faults.from_env()
    learner_cls = ray.remote(LearnerActor)
    # max_task_retries=-1: a call caught by a restart is rerun on the restarted actor (a rollout then refuses with
    # StaleRevision until the driver has loaded the current revision into it again).
    restarts = config.rollout.max_restarts
    rollout_cls = ray.remote(max_restarts=restarts, max_task_retries=-1 if restarts else 0)(RolloutActor)
    try:
        cluster.learners = learners = [
            learner_cls.options(**on(s)).remote(config, paths[node_of[s.actor]], i, n, faults)
            for i, s in enumerate(layout.learners)
        ]
        cluster.rollouts = rollouts = [
            rollout_cls.options(**on(s)).remote(rollout_config, paths[node_of[s.actor]], j)  # j: its engines
            for j, s in enumerate(layout.rollouts)
        ]
        addr, port = ray.get(learners[0].address.remote())
        gather([lr.setup.remote(addr, port, init_lora) for lr in learners], cluster, "setup")
        actors = [s.actor for s in layout.slots]
        places = ray.get([a.where.remote() for a in learners + rollouts])
        # "(pid N on IP)" plus the node id: several nodes may share an address (containers, a test cluster).
        cluster.where = {a: f"{p[:-1]}, node {node_of[a][:8]})" for a, p in zip(actors, places, strict=True)}
        cluster.rollout_pids = ray.get([a.pid.remote() for a in rollouts])
        if run_dir is not None:
            _write_placement(run_dir, cluster, paths)
        threading.Thread(target=_watch, args=(cluster, names), daemon=True, name="mint-node-watch").start()
    except BaseException:
        cluster.close(shutdown=False)
        raise
    return cluster


def _write_placement(run_dir, cluster: Cluster, paths: dict[str, str]) -> None:
    """<run>/placement.json: the layout, and where each actor runs with the model path it loaded (atomically)."""
    actors = {
        a: {"node": node, "where": cluster.where[a], "model_path": paths[node]} for a, node in cluster.nodes.items()
    }
    path = os.path.join(run_dir, "placement.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"layout": cluster.layout.to_dict(), "actors": actors}, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)


def _watch(cluster: Cluster, names: dict[str, str]) -> None:
    """The watchdog: when a node holding actors of `cluster` leaves, kill those actors so that every call waiting on
    them fails at once (a rollout actor would otherwise wait forever to restart on the node that is gone), and mark
    the cluster lost. Ends with the cluster."""
    used = set(cluster.nodes.values())
    while not cluster._stop.wait(NODE_POLL_S):
        try:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        except Exception:  # Ray shutting down under us: the run is ending anyway
            return
        gone = used - alive
        if not gone:
            continue
        node = sorted(gone)[0]
        on_it = [a for a, n in cluster.nodes.items() if n in gone]
        cluster.lost = f"node {names.get(node, node[:8])} left the cluster with {', '.join(on_it)} on it"
        handles = dict(zip([s.actor for s in cluster.layout.slots], cluster.learners + cluster.rollouts, strict=True))
        for actor in on_it:
            ray.kill(handles[actor], no_restart=True)
        return


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
    futures, revived = submit_loads(cluster, rev_id, data_ref), False
    for i, future in enumerate(futures):
        try:
            ray.get(future)
        except ACTOR_GONE:
            _reload(cluster, i, rev_id, data_ref)
        except MintError:
            revived = revive_engines(cluster) or revived  # a dead engine server: restarted, or named in one line
            if not revived:
                raise
            _reload(cluster, i, rev_id, data_ref)
    _count_restarts(cluster)


def submit_sync(cluster: Cluster, data_ref) -> list:
    """Weight sync without the driver hop, queued on every rollout actor without waiting: each fetches the learner's
    bytes (`data_ref`, the object ref rank 0's `lora_state_bytes` returned) from the learner's node, hashes them once
    and installs that revision (on its engines, for an HTTP backend). Queued like `submit_loads`: after the rollouts
    already queued on the actor, before the ones queued later."""
    return [actor.sync_adapter.remote(data_ref) for actor in cluster.rollouts]


def finish_sync(cluster: Cluster, futures: list, data_ref) -> tuple[str, float]:
    """Wait for `submit_sync`'s calls: (revision id, the slowest actor's own seconds). Every actor must have hashed
    the bytes to the same id; one that died is loaded again, by that id, once Ray has restarted it. Then every
    actor's pid is asked, to count restarts."""
    ids, seconds, dead, revived = [], [], [], False
    for i, future in enumerate(futures):
        try:
            out = ray.get(future)
        except ACTOR_GONE:
            dead.append(i)
            continue
        except MintError:
            revived = revive_engines(cluster) or revived  # a dead engine server: restarted, or named in one line
            if not revived:
                raise
            out = ray.get(cluster.rollouts[i].sync_adapter.remote(data_ref))  # the sync again, on the new server
        ids.append(out["revision"])
        seconds.append(out["sync_s"])
    if len(set(ids)) > 1:
        raise MintError(f"weight sync: rollout actors hashed the learner's bytes to {len(set(ids))} different ids")
    if not ids:
        raise MintError("weight sync: every rollout actor died during the sync")
    for i in dead:
        _reload(cluster, i, ids[0], data_ref)
    _count_restarts(cluster)
    return ids[0], max(seconds)


def _count_restarts(cluster: Cluster) -> None:
    """Ray may restart a dead actor and retry a call on it without the driver seeing an error (a load caught by the
    restart): count restarts by the actors' process ids instead."""
    pids = ray.get([actor.pid.remote() for actor in cluster.rollouts])
    cluster.rollout_restarts += sum(a != b for a, b in zip(pids, cluster.rollout_pids, strict=True))
    cluster.rollout_pids = pids


def _reload(cluster: Cluster, i: int, rev_id: str, data_ref) -> None:
    """Load a revision into rollout actor i after Ray restarted it, or after it missed one (a load refused by a dead
    engine server, which is restarted here: revive_engines); one line when either is out of restarts."""
    deadline = time.monotonic() + RESTART_WAIT_S
    while True:
        try:  # retried by Ray once the actor is back; raises when it is out of restarts
            ray.get(cluster.rollouts[i].load_adapter.remote(rev_id, data_ref))
            return
        except EngineError:
            if not revive_engines(cluster):  # no engine died: the server itself refused the load
                raise
        except ACTOR_GONE as err:
            if cluster.lost:  # its node is gone: the driver restarts the actors (NodeLost), no use waiting
                raise NodeLost(cluster.lost) from err
            if time.monotonic() > deadline:
                place = cluster.where.get(f"rollout actor {i}", "")
                raise MintError(f"rollout actor {i} {place} died and did not come back".replace("  ", " ")) from err
            time.sleep(1.0)


# ---- rollouts in flight: how the overlapped loop (rollout.max_staleness) submits ahead and collects later ----------


def submit_loads(cluster: Cluster, rev_id: str, data_ref) -> list:
    """Queue the hot-load of a revision on every rollout actor and return the calls, in actor order, without waiting.

    An actor runs one call at a time, in the order the driver made them (Ray's ordering for a threaded actor of
    concurrency 1), so a rollout queued before this load samples with the old adapter and one queued after it with
    the new one: a load never lands in the middle of a step's rollout.
    """
    return [actor.load_adapter.remote(rev_id, data_ref) for actor in cluster.rollouts]


@dataclass
class RolloutCall:
    """One step's rollout in flight: each actor's shard of the prompts, the revision it samples with, the calls."""

    shards: list[list]
    seed: int
    rev_id: str
    data_ref: object  # the revision's bytes in the object store, to load it again into a restarted actor
    futures: dict[int, object]  # actor index -> its rollout call
    pids: dict[int, object]  # actor index -> pid() queued right behind the rollout call
    evaluate: tuple[int, float] | None = None  # (samples, temperature): an eval pass (RolloutActor.evaluate)


def submit_rollout(
    cluster: Cluster, examples: list, seed: int, rev_id: str, data_ref, evaluate: tuple[int, float] | None = None
) -> RolloutCall:
    """Spread the step's prompts over the rollout actors (each group stays on one actor: shared prefix) and queue the
    calls without waiting. Shard i samples with seed `seed * 1000 + i`, whenever it runs. With `evaluate` =
    (samples, temperature) the calls are an eval pass instead, shard i seeded `seed + i`; collect_rollout recovers
    both alike."""
    n = len(cluster.rollouts)
    shards = [examples[i::n] for i in range(n)]
    call = RolloutCall(shards, seed, rev_id, data_ref, {}, {}, evaluate)
    call.futures = {i: _shard_call(cluster, call, i) for i in range(n) if shards[i]}
    # The actor's pid, asked right behind the rollout: a restart shows as a new pid without waiting on the calls
    # queued after this one (a blocking pid() would wait for the next steps' rollouts too). Not behind an eval pass:
    # with rollouts queued ahead of it (max_staleness >= 1) its pid would be read before theirs, out of order, and
    # count one restart several times; the next rollout's pid shows the restart.
    if evaluate is None:
        call.pids = {i: cluster.rollouts[i].pid.remote() for i in call.futures}
    return call


def _shard_call(cluster: Cluster, call: RolloutCall, i: int):
    if call.evaluate is not None:
        samples, temperature = call.evaluate
        return cluster.rollouts[i].evaluate.remote(call.shards[i], samples, temperature, call.seed + i, call.rev_id)
    return cluster.rollouts[i].rollout.remote(call.shards[i], call.seed * 1000 + i, call.rev_id)


def collect_rollout(cluster: Cluster, call: RolloutCall, current: tuple[str, object] | None = None) -> list:
    """Wait for a step's rollout: its groups, in the order of the step's prompts.

    A shard whose actor died (or was restarted by Ray since its load, so holds another adapter: StaleRevision) is
    redone once the actor holds the call's revision again, with the same seed: a step's samples always come from the
    revision it was submitted with. `current` = (id, bytes ref) of the newest revision: when it differs, it is loaded
    back into a redone actor afterwards. A shard that failed on an engine server the run started, which died, is
    redone the same way once the server is restarted and holds the actor's revision again (`revive_engines`). An
    actor or engine out of restarts ends the run with one line.
    """
    results: list[list] = [[] for _ in cluster.rollouts]
    futures, redone, revived = dict(call.futures), [], False
    for attempt in range(2):
        dead = []
        for i, future in futures.items():
            try:
                results[i] = ray.get(future)
            except (*ACTOR_GONE, StaleRevision):
                dead.append(i)
            except MintError:
                if attempt == 1:
                    check_engines(cluster.engines)  # a dead engine server is the cause: name it and its log
                    raise
                revived = revive_engines(cluster) or revived  # restarted (then redone below), or one line
                if not revived:
                    raise
                dead.append(i)
        if not dead:
            break
        if attempt == 1:
            raise MintError(f"rollout actor {dead[0]} died again after a restart; stopping")
        for i in dead:
            _reload(cluster, i, call.rev_id, call.data_ref)
        futures, redone = {i: _shard_call(cluster, call, i) for i in dead}, dead
    if current is not None and current[0] != call.rev_id:
        for i in redone:  # the reload above put an older revision back: the next steps sample with the newest
            _reload(cluster, i, *current)
    _count_pids(cluster, call.pids)
    return [group for shard in results for group in shard]


def _count_pids(cluster: Cluster, pids: dict[int, object]) -> None:
    """Count restarts from the pids asked behind a step's rollout calls (as _count_restarts, without blocking)."""
    for i, future in pids.items():
        try:
            pid = ray.get(future)
        except ACTOR_GONE:
            continue  # the rollout's own retry already dealt with (or reported) this actor
        if pid != cluster.rollout_pids[i]:
            cluster.rollout_restarts += 1
            cluster.rollout_pids[i] = pid
