"""One session's cluster: the learner group and the rollout fleet, the placement group that holds them, and the
watchdog that notices a node leaving.

- Placement follows mint.train.placement (per-node bundles): `reserve` plans the layout on the alive nodes and
  waits for the cluster to grant it. The driver then checks every node the layout uses (mint.train.nodes) before
  `start_cluster` creates any actor: the rollout fleet (mint.train.rollout_fleet: the engine servers first, then the
  rollout actors) and the learner group (mint.train.learner_group), each on its bundles, each loading the model from
  its own node's path.
- The watchdog thread notices a node that leaves the cluster with actors on it, has their owner kill them (Ray would
  wait to restart them on a node that is gone) and marks the cluster `lost`; the driver then restarts the actors from
  the latest checkpoint on the nodes that are left (`NodeLost`, the same rule as a dead learner rank), or stops with
  one line when they cannot hold the layout.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import psutil
import ray
from ray.runtime_context import get_runtime_context
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from mint.config import Config
from mint.errors import MintError
from mint.train.learner_group import LearnerGroup
from mint.train.nodes import check_node, cluster_nodes, connect, node_checks
from mint.train.placement import Layout, Slot, node_name, plan_layout
from mint.train.rollout_fleet import RolloutFleet

# How long the placement group may take to be reserved: the layout was planned on free nodes, so longer means
# another job holds their resources.
PLACEMENT_WAIT_S = 120.0
# How often the watchdog asks the GCS which nodes are alive (one small RPC).
NODE_POLL_S = 1.0
# After the n-th failed ask in a row the watchdog waits NODE_POLL_S x 2^n, at most NODE_POLL_MAX_S (2, 4, 8, 16, 16,
# ... s), and it gives up at NODE_POLL_FAILURES failures in a row, about two minutes after the first: longer than a
# GCS restart takes, and a run whose GCS stays away that long fails its next call anyway.
NODE_POLL_MAX_S = 16.0
NODE_POLL_FAILURES = 10
# How long a local Ray's processes get to exit after ray.shutdown() before they are killed: an actor that was just
# killed may still be running its exit path (DeepSpeed's and gloo's threads) when the raylet goes.
RAY_EXIT_WAIT_S = 15.0


class NodeLost(MintError):
    """A node left the cluster with actors of this run on it; they restart from the latest checkpoint elsewhere."""


def start_ray(config: Config) -> LocalRay | None:
    """Join `ray.address`, or start a local Ray sized for the run's bundles (returned: the caller stops it)."""
    if ray.is_initialized():
        return None
    r = config.ray
    if r.address:
        connect(r.address)
        return None
    n_bundles = config.learner.num_ranks * r.learner_cpus + config.rollout.num_actors * r.rollout_cpus
    # A local cluster gets at least one logical CPU per bundle: tiny actors share 2 cores fine.
    local_cpus = max(os.cpu_count() or 1, math.ceil(n_bundles))
    local = LocalRay(_descendants())
    # Actor logs stay in Ray's session folder: the driver's stdout ends with one JSON line, nothing after it.
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=local_cpus)
    return local


@dataclass
class LocalRay:
    """A Ray this process started. `before`: the ids of the processes this one had started before it (a test's
    server, say), which are not Ray's to stop."""

    before: set[int]

    def stop(self) -> None:
        """Shut Ray down and wait until every process it started has exited.

        ray.shutdown() sends the raylet SIGTERM and, one second later, SIGKILL; the raylet stops its workers only on
        the graceful path. On a loaded machine the second can pass first, and the orphaned workers exit only when
        they notice their raylet is gone: a Ctrl-C'd `mint train` returned to the shell with a learner rank still
        alive. So Ray's processes are listed before the shutdown and waited for after it; one still alive after
        RAY_EXIT_WAIT_S is killed."""
        ours = [p for p in psutil.Process().children(recursive=True) if p.pid not in self.before]
        if ray.is_initialized():
            ray.shutdown()
        alive = _wait_gone(ours, RAY_EXIT_WAIT_S)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        _wait_gone(alive, RAY_EXIT_WAIT_S)


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until none of `procs` runs; returns those still running after `timeout`. A zombie counts as gone: once
    the raylet has exited, its workers are reaped by whoever adopts them, which in a container may be never."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@dataclass
class Placement:
    """The run's layout reserved on the cluster: its placement group, and the node each actor's bundle got."""

    layout: Layout
    pg: object
    node_of: dict[str, str]  # actor name ("learner rank 0") -> the id of the node its bundle is on
    names: dict[str, str]  # node id -> "name (1a2b3c4d)", for messages
    _released: bool = field(default=False, repr=False)

    def nodes(self, slots: list[Slot]) -> list[str]:
        """The node id of each actor of `slots`, in order."""
        return [self.node_of[s.actor] for s in slots]

    def options(self, slots: list[Slot]) -> list[dict]:
        """The Ray options that place each actor of `slots` in its bundle, with its CPUs and GPUs."""
        return [
            dict(
                num_cpus=s.cpus,
                num_gpus=s.gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=s.bundle
                ),
            )
            for s in slots
        ]

    def release(self) -> None:
        """Free the placement group (once)."""
        if not self._released:
            self._released = True
            remove_placement_group(self.pg)


def reserve(config: Config) -> Placement:
    """Plan the layout on the alive nodes and reserve it; one line when the cluster does not grant it in time."""
    layout = plan_layout(config, cluster_nodes())
    selectors = {"bundle_label_selector": list(layout.selectors)} if layout.selectors else {}
    pg = placement_group(list(layout.bundles), strategy=layout.strategy, **selectors)
    try:
        if not pg.wait(PLACEMENT_WAIT_S):
            raise MintError(
                f"placement: the cluster did not grant the layout's bundles within {PLACEMENT_WAIT_S:g} s "
                f"({', '.join(map(str, layout.bundles))}); another job may hold those nodes' CPUs or GPUs"
            )
        bundle_node = placement_group_table(pg)["bundles_to_node_id"]
        names = {n["NodeID"]: f"{node_name(n)} ({n['NodeID'][:8]})" for n in ray.nodes()}
    except BaseException:
        remove_placement_group(pg)
        raise
    node_of = {s.actor: bundle_node[s.bundle] for s in layout.slots}
    return Placement(layout, pg, node_of, {n: names[n] for n in set(node_of.values())})


@dataclass
class Cluster:
    """The actors of one session: the learner group, the rollout fleet, and the placement that holds them."""

    learners: LearnerGroup
    fleet: RolloutFleet
    placement: Placement
    lost: str = ""  # set by the watchdog: which node left, with which actors
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    def where(self) -> dict[str, str]:
        """Actor name -> where it runs ("learner rank 1" -> "(pid 123 on 10.0.0.2, node 1a2b3c4d)")."""
        layout = self.placement.layout
        return {
            **{s.actor: w for s, w in zip(layout.learners, self.learners.where, strict=True)},
            **{s.actor: w for s, w in zip(layout.rollouts, self.fleet.where, strict=True)},
        }

    def close(self) -> None:
        """Stop the watchdog, kill the actors and the engine servers, and free the placement group."""
        self._stop.set()
        self.learners.close()
        self.fleet.close()
        self.placement.release()


def start_cluster(config: Config, placement: Placement, model_path: str, init_lora: bytes | None, run_dir) -> Cluster:
    """Check every node of the reserved layout (`check_nodes`), create the actors on it, each loading the model from
    its node's path, and wire the learner's process group; then write placement.json into `run_dir` (when given) and
    start the watchdog. The caller releases `placement` when this raises."""
    paths = check_nodes(config, placement, model_path, run_dir)
    layout = placement.layout
    learner_nodes, rollout_nodes = placement.nodes(layout.learners), placement.nodes(layout.rollouts)
    fleet = RolloutFleet.start(
        config, model_path, run_dir, placement.options(layout.rollouts), [paths[n] for n in rollout_nodes]
    )
    try:
        options = placement.options(layout.learners)
        learners = LearnerGroup.start(config, options, [paths[n] for n in learner_nodes], learner_nodes, init_lora)
        fleet.locate(rollout_nodes)
    except BaseException:
        fleet.close()
        raise
    cluster = Cluster(learners, fleet, placement)
    try:
        if run_dir is not None:
            _write_placement(run_dir, cluster, paths)
        threading.Thread(target=_watch, args=(cluster,), daemon=True, name="mint-node-watch").start()
    except BaseException:
        cluster.close()
        raise
    return cluster


def check_nodes(config: Config, placement: Placement, model_path: str, run_dir) -> dict[str, str]:
    """Before any actor: every node of the layout must hold the model (a tiny base is shipped) and, for learner
    nodes, see the run directory; one line naming the node when not. One task per node, pinned to it, except the
    driver's own node on a Ray this process started, checked here (mint.train.nodes). Returns node id -> the model
    path its actors load."""
    learner_nodes = set(placement.nodes(placement.layout.learners))
    here = None if config.ray.address else get_runtime_context().get_node_id()  # a local Ray: checked in the driver
    checks = node_checks(config, model_path, placement.names, learner_nodes, run_dir, local=here)
    task = ray.remote(num_cpus=0, max_retries=0)(check_node)
    try:
        futures = {
            node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args)
            for node, args in checks.args.items()
            if node != here
        }
        answers = [(here, check_node(*checks.args[here]))] if here in checks.args else []
        return checks.paths(itertools.chain(answers, ((node, ray.get(future)) for node, future in futures.items())))
    finally:
        checks.close()


def _write_placement(run_dir, cluster: Cluster, paths: dict[str, str]) -> None:
    """<run>/placement.json: the layout, and where each actor runs with the model path it loaded (atomically)."""
    where, placement = cluster.where(), cluster.placement
    actors = {a: {"node": node, "where": where[a], "model_path": paths[node]} for a, node in placement.node_of.items()}
    path = os.path.join(run_dir, "placement.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"layout": placement.layout.to_dict(), "actors": actors}, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)


def _watch(cluster: Cluster) -> None:
    """The watchdog: when a node holding actors of `cluster` leaves, have their owners kill them, so that every call
    waiting on them fails at once, and mark the cluster lost. Ends with the cluster.

    A failed `ray.nodes()` (the GCS restarting or briefly unreachable) is tried again with backoff; only
    NODE_POLL_FAILURES failures in a row stop the watchdog, with one line on stderr. When the run is ending, the
    cluster's stop event ends the wait at once."""
    placement = cluster.placement
    layout, node_of = placement.layout, placement.node_of
    used = set(node_of.values())
    failures, wait = 0, NODE_POLL_S
    while not cluster._stop.wait(wait):
        try:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        except Exception as err:
            failures += 1
            if failures >= NODE_POLL_FAILURES:
                if not cluster._stop.is_set():
                    detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
                    print(
                        f"mint: the node watchdog stopped: ray.nodes() failed {failures} times in a row (last: "
                        f"{detail}); a node that leaves is now noticed only when a call on it fails",
                        file=sys.stderr,
                        flush=True,
                    )
                return
            wait = min(NODE_POLL_S * 2**failures, NODE_POLL_MAX_S)
            continue
        failures, wait = 0, NODE_POLL_S
        gone = used - alive
        if not gone:
            continue
        node = sorted(gone)[0]
        on_it = [a for a, n in node_of.items() if n in gone]
        cluster.lost = f"node {placement.names.get(node, node[:8])} left the cluster with {', '.join(on_it)} on it"
        cluster.fleet.node_left(cluster.lost, [j for j, s in enumerate(layout.rollouts) if s.actor in on_it])
        cluster.learners.kill([i for i, s in enumerate(layout.learners) if s.actor in on_it])
        return
