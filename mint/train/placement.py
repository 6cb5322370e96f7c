"""Where each actor of a run goes: a placement-group layout with per-node bundles (docs/multinode.md).

`plan_layout` is a pure function of the recipe and the cluster's nodes, so `mint train RECIPE --dry-run` prints the
same layout a run then reserves. The rules (`ray.placement = "nodes"`, the default):

- Nodes are taken in a fixed order: the driver's node first, then by address and node id.
- Learner ranks fill nodes in that order, as many per node as its CPUs and GPUs hold (NVLink stays inside a
  node). An expert- or context-parallel group (`learner.expert_parallel` x `longstraw.context_parallel` consecutive
  ranks) is never split across nodes when one node can hold it: a node takes whole groups only.
- Rollout actors go to nodes without a learner rank first (whole nodes), then onto GPUs no learner rank uses.
  They share a GPU with a learner rank only when the recipe asks (`ray.colocate = true`, fractional GPUs such as
  learner_gpus = rollout_gpus = 0.5), and then they fill the learner nodes first.
- Each node gets one bundle per role (learner, rollout), or one shared bundle when colocated, holding the sum of
  its actors' CPUs and whole GPUs; a label selector (`ray.io/node-id`) pins it to its node. Ray hands each actor
  GPUs from its own bundle, so two roles never meet on a GPU unless they share a bundle.

The other `ray.placement` values (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD) keep one bundle per actor placed by
Ray with that strategy: no per-node plan, and the nodes are known only once the placement group is ready.

GPU numbers in the layout are positions among a node's GPUs as planned, not CUDA device ids: Ray picks the devices
inside each bundle.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from mint.config import Config
from mint.errors import MintError

NODE_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id
_EPS = 1e-9


@dataclass(frozen=True)
class Node:
    """One Ray node as the planner sees it: its id, address and total CPUs and GPUs."""

    node_id: str
    address: str
    cpus: float
    gpus: float
    driver: bool = False  # the node the driver runs on

    @property
    def name(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"


@dataclass(frozen=True)
class Slot:
    """One actor's place: its node (index into Layout.nodes; None when Ray decides) and bundle."""

    actor: str  # "learner rank 0", "rollout actor 1": how errors and logs name it
    learner: bool
    node: int | None
    bundle: int
    cpus: float
    gpus: float
    gpu_index: tuple[int, ...] = ()  # the node's GPUs it is planned on (positions, not CUDA ids)


@dataclass(frozen=True)
class Layout:
    """The placement group of a run: bundles (with their pinning selectors) and where every actor goes."""

    nodes: tuple[Node, ...]
    bundles: tuple[dict, ...]
    selectors: tuple[dict, ...] | None  # one label selector per bundle; None: Ray places the bundles
    slots: tuple[Slot, ...]  # learner ranks in rank order, then rollout actors
    strategy: str
    notes: tuple[str, ...] = field(default=())

    @property
    def learners(self) -> list[Slot]:
        return [s for s in self.slots if s.learner]

    @property
    def rollouts(self) -> list[Slot]:
        return [s for s in self.slots if not s.learner]

    def table(self) -> str:
        """The layout as text: one line per node, then one per actor."""
        pinned = self.selectors is not None
        how = "per-node bundles" if pinned else f"one bundle per actor, placed by Ray ({self.strategy})"
        lines = [f"placement: {len(self.bundles)} bundle(s), {how}"]
        for i, node in enumerate(self.nodes):
            here = [s for s in self.slots if s.node == i]
            if not here:
                continue
            roles = ", ".join(
                f"{sum(s.learner == r for s in here)} {n}" for r, n in ((True, "learner"), (False, "rollout"))
            )
            bundles = sorted({s.bundle for s in here})
            held = ", ".join(f"{b} {_res(self.bundles[b])}" for b in bundles)
            lines.append(
                f"  node {i}: {node.name}{' [driver]' if node.driver else ''}, {_num(node.cpus)} CPU, "
                f"{_num(node.gpus)} GPU; bundle {held}; {roles}"
            )
        width = max(len(s.actor) for s in self.slots)
        for s in self.slots:
            where = f"node {s.node}" if s.node is not None else f"bundle {s.bundle} (node chosen by Ray)"
            share = f" ({_num(s.gpus)} of it)" if 0 < s.gpus < 1 else ""
            gpus = f"GPU {','.join(map(str, s.gpu_index))}{share}" if s.gpus else "no GPU"
            lines.append(f"  {s.actor:<{width}}  {where}, bundle {s.bundle}, {_num(s.cpus)} CPU, {gpus}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)


def _num(x: float) -> str:
    return f"{x:g}"


def _res(bundle: dict) -> str:
    return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in bundle.items()) + "}"


class _Room:
    """What is left on one node while planning: CPUs, and each GPU's free fraction and which roles hold it."""

    def __init__(self, node: Node):
        self.cpus = node.cpus
        self.free = [1.0] * int(node.gpus + _EPS)
        self.roles: list[set[bool]] = [set() for _ in self.free]

    def fit(self, cpus: float, gpus: float, learner: bool, share: bool) -> tuple[int, ...] | None:
        """The GPUs an actor would take here (() for none), or None when it does not fit."""
        if self.cpus + _EPS < cpus:
            return None
        if gpus <= 0:
            return ()
        ok = [g for g in range(len(self.free)) if share or not self.roles[g] or self.roles[g] == {learner}]
        if gpus >= 1:  # whole GPUs: Ray asks for an integer count above one
            whole = [g for g in ok if self.free[g] >= 1.0 - _EPS][: math.ceil(gpus - _EPS)]
            return tuple(whole) if len(whole) == math.ceil(gpus - _EPS) else None
        part = next((g for g in ok if self.free[g] + _EPS >= gpus), None)
        return None if part is None else (part,)

    def take(self, cpus: float, gpus: float, learner: bool, index: tuple[int, ...]) -> None:
        self.cpus -= cpus
        for g in index:
            self.free[g] -= min(gpus, 1.0)
            self.roles[g].add(learner)


def parallel_group(config: Config) -> int:
    """Consecutive learner ranks that must share a node when they can: one expert- x context-parallel group."""
    ep, cp = config.learner.expert_parallel, config.longstraw.context_parallel
    return max(1, int(ep)) * max(1, int(cp))


def order_nodes(nodes: list[Node]) -> list[Node]:
    """The fill order: the driver's node first, then by address and id (stable across calls)."""
    return sorted(nodes, key=lambda n: (not n.driver, n.address, n.node_id))


def plan_layout(config: Config, nodes: list[Node]) -> Layout:
    """The placement of `config`'s actors on `nodes` (alive Ray nodes). Raises MintError (one line naming what is
    missing) when they do not fit. See the module docstring for the rules."""
    r = config.ray
    n_learn, n_roll = config.learner.num_ranks, config.rollout.num_actors
    if r.placement != "nodes":
        bundles = [_bundle(r.learner_cpus, r.learner_gpus)] * n_learn + [
            _bundle(r.rollout_cpus, r.rollout_gpus)
        ] * n_roll
        slots = [Slot(f"learner rank {i}", True, None, i, r.learner_cpus, r.learner_gpus) for i in range(n_learn)]
        slots += [
            Slot(f"rollout actor {j}", False, None, n_learn + j, r.rollout_cpus, r.rollout_gpus) for j in range(n_roll)
        ]
        return Layout(tuple(order_nodes(nodes)), tuple(bundles), None, tuple(slots), r.placement)
    ordered = order_nodes(nodes)
    rooms = [_Room(n) for n in ordered]
    group, notes = parallel_group(config), []
    placed: list[tuple[int, tuple[int, ...]]] = []  # (node, gpus) per learner rank
    for i, room in enumerate(rooms):
        left = n_learn - len(placed)
        if not left:
            break
        fits = _count(room, r.learner_cpus, r.learner_gpus)
        take = min(fits, left)
        if group > 1 and fits >= group and take < left:
            take -= take % group  # whole groups only, unless this node ends the learner
        elif group > 1 and 0 < fits < group:
            notes.append(
                f"node {i} holds {fits} learner rank(s), fewer than one parallel group of {group}: it spans nodes"
            )
        for _ in range(take):
            index = room.fit(r.learner_cpus, r.learner_gpus, True, False)
            room.take(r.learner_cpus, r.learner_gpus, True, index)
            placed.append((i, index))
    if len(placed) < n_learn:
        raise MintError(
            f"placement: {n_learn} learner rank(s) of {_need(r.learner_cpus, r.learner_gpus)} each do not fit the "
            f"{_have(ordered)}; {len(placed)} fit; add nodes, or lower learner.num_ranks or ray.learner_cpus/gpus"
        )
    learner_nodes = {node for node, _ in placed}
    rest = [i for i in range(len(rooms)) if i not in learner_nodes]
    candidates = sorted(learner_nodes) + rest if r.colocate else rest + sorted(learner_nodes)
    rolled: list[tuple[int, tuple[int, ...]]] = []
    for _ in range(n_roll):
        spot = next(
            (
                (i, ix)
                for i in candidates
                if (ix := rooms[i].fit(r.rollout_cpus, r.rollout_gpus, False, r.colocate)) is not None
            ),
            None,
        )
        if spot is None:
            shared = "" if r.colocate else " (without ray.colocate, never on a GPU a learner rank uses)"
            raise MintError(
                f"placement: {n_roll} rollout actor(s) of {_need(r.rollout_cpus, r.rollout_gpus)} each do not fit "
                f"beside the learner{shared} on the {_have(ordered)}; {len(rolled)} fit; add nodes, or lower "
                "rollout.num_actors or ray.rollout_cpus/gpus"
            )
        rooms[spot[0]].take(r.rollout_cpus, r.rollout_gpus, False, spot[1])
        rolled.append(spot)
    return _assemble(config, ordered, placed, rolled, notes)


def _assemble(config: Config, nodes: list[Node], placed: list, rolled: list, notes: list[str]) -> Layout:
    """Group the actors into one bundle per (node, role), or per node when colocated, pinned to its node."""
    r = config.ray
    actors = [(f"learner rank {k}", True, n, ix, r.learner_cpus, r.learner_gpus) for k, (n, ix) in enumerate(placed)]
    actors += [(f"rollout actor {k}", False, n, ix, r.rollout_cpus, r.rollout_gpus) for k, (n, ix) in enumerate(rolled)]
    keys: list[tuple[int, bool]] = []
    for _, learner, node, *_ in actors:
        key = (node, True if r.colocate else learner)
        if key not in keys:
            keys.append(key)
    bundles, slots = [], []
    for key in keys:
        members = [a for a in actors if (a[2], True if r.colocate else a[1]) == key]
        gpus = len({g for a in members for g in a[3]})
        bundles.append(_bundle(sum(a[4] for a in members), gpus))
    for actor, learner, node, index, cpus, gpus in actors:
        bundle = keys.index((node, True if r.colocate else learner))
        slots.append(Slot(actor, learner, node, bundle, cpus, gpus, index))
    selectors = tuple({NODE_LABEL: nodes[node].node_id} for node, _ in keys)
    return Layout(tuple(nodes), tuple(bundles), selectors, tuple(slots), "PACK", tuple(notes))


def _count(room: _Room, cpus: float, gpus: float) -> int:
    """How many actors of (cpus, gpus) fit in what is left of a node, planned one after another."""
    trial = _Room(Node("", "", room.cpus, 0))
    trial.free, trial.roles = list(room.free), [set(s) for s in room.roles]
    n = 0
    while (index := trial.fit(cpus, gpus, True, False)) is not None:
        trial.take(cpus, gpus, True, index)
        n += 1
        if not gpus and cpus <= 0:
            break
    return n


def _bundle(cpus: float, gpus: float) -> dict:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def _need(cpus: float, gpus: float) -> str:
    return f"{_num(cpus)} CPU" + (f" + {_num(gpus)} GPU" if gpus else "")


def _have(nodes: list[Node]) -> str:
    each = "; ".join(f"{n.name}: {_num(n.cpus)} CPU, {_num(n.gpus)} GPU" for n in nodes)
    return f"{len(nodes)} alive node(s) ({each})"


def node_name(entry: dict) -> str:
    """How messages name a node of `ray.nodes()`: its name (`ray start --node-name`, by default its address)."""
    return entry.get("NodeName") or entry.get("NodeManagerAddress") or "?"


def local_node(config: Config) -> Node:
    """The one node `mint.train.cluster.start_ray` would start without `ray.address` (for a dry run: nothing starts):
    as many CPUs as the actors reserve, at least the machine's; the GPUs torch sees."""
    r = config.ray
    need = config.learner.num_ranks * r.learner_cpus + config.rollout.num_actors * r.rollout_cpus
    gpus = 0
    if r.learner_gpus or r.rollout_gpus:
        import torch

        gpus = torch.cuda.device_count()
    return Node("local", "this machine", float(max(os.cpu_count() or 1, math.ceil(need))), float(gpus), True)


def memory_plan(config: Config, prompt_len: int, gpu_memory: str) -> str:
    """The per-GPU memory plan of a learner rank (mint.models.plan) for a base with known real shapes, else a line
    saying why there is none."""
    from mint.models.plan import Job, hub_shape, make_plan, parse_bytes
    from mint.models.shapes import shape

    key = hub_shape(config.model.path)
    if key is None:
        return f"memory plan: none for {config.model.path} (not a known real base; `mint plan --shape` sizes one)"
    job = Job(
        prompt_len=max(1, prompt_len),
        group=config.rollout.group_size,
        response_len=config.rollout.max_tokens,
        lora_rank=config.lora.rank,
        chunk=config.longstraw.chunk_size,
        mode="detached" if config.longstraw.mode != "exact" else "exact",
        data_parallel=config.learner.num_ranks,
        expert_parallel=config.learner.expert_parallel,
        context_parallel=config.longstraw.context_parallel,
        dtype_bytes=4 if config.model.dtype == "float32" else 2,
        indexer_replay=config.grpo.indexer_replay,
    )
    plan = make_plan(shape(key), key, job, parse_bytes(gpu_memory))
    return f"memory plan per learner GPU ({gpu_memory}, P = the longest checked prompt):\n{plan.table()}"
