"""The rollout fleet: the rollout actors of one session, the engine servers they front, and every call to them.

- **Rollout actors** hold nothing but the current revision. Ray restarts a dead one (`rollout.max_restarts`) and
  reruns the call it was running; the restarted actor holds no revision, so a rollout refuses (`StaleRevision`)
  until the fleet has loaded the call's revision into it again. Restarts are counted by the actors' process ids.
- **Engine servers** the run started (`engines.start`, mint.train.engine_servers) start before the actors, which see
  their URLs as engines.urls. A dead one is restarted (engines.restarts) on the same URL, and every actor that fronts
  it loads its current revision on it again (`_revive_engines`).
- **One recovery path.** Every call the fleet waits for (a step's rollout, an eval pass, a revision load) is caught
  by one exception filter, `FAILURES`: the actor died, it was restarted since its load (StaleRevision), or an engine
  failed (EngineError). `_recover_from` judges each the same way: an engine failure restarts the dead servers, and
  is raised when no server died since the call was made (the engine's answer, not its death); an actor on a node
  that left is not waited for. Then the actor is loaded with the call's revision again (`_reload`, waiting for Ray
  to bring a dead actor back) and the call is redone with its seed: a step's samples always come from the revision
  it was submitted with. A redone call that fails again ends the run with one line.

An actor runs one call at a time, in the order the driver made them (Ray's ordering for a threaded actor of
concurrency 1), so a load queued behind a step's rollout (`queue_load`, the overlapped loop) never lands in the
middle of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError, RayTaskError

from mint.config import Config
from mint.errors import MintError
from mint.rollout.backends import EngineError
from mint.rollout.backends.base import EngineUnreachable
from mint.train.engine_servers import EngineServers
from mint.train.rollout_actor import RolloutActor, StaleRevision
from mint.train.step import Revision

# The one exception filter of every call the fleet waits for (the module docstring says what each means).
# RayActorError covers ActorDiedError and ActorUnavailableError, its subclasses.
FAILURES = (RayActorError, StaleRevision, EngineError)
# How long a reload waits for Ray to bring a dead rollout actor back (it reloads its model: seconds on CPU).
RESTART_WAIT_S = 300.0
# How long an engine that refuses connections is watched for its death before its error ends the run.
DEATH_WAIT_S = 15.0


@dataclass
class RolloutCall:
    """One step's rollout (or eval pass) in flight: each actor's shard of the prompts, the revision it samples with,
    the calls."""

    shards: list[list]
    seed: int
    revision: Revision  # its bytes in the object store load it again into a restarted actor
    futures: dict[int, object]  # actor index -> its rollout call
    pids: dict[int, object]  # actor index -> pid() queued right behind the rollout call
    evaluate: tuple[int, float] | None = None  # (samples, temperature): an eval pass (RolloutActor.evaluate)
    generation: int = 0  # the fleet's engine generation when the call was made (`_recover_from`)


class RolloutFleet:
    """The rollout actors (`actors[j]` fronts urls[j::num_actors] of the engines) and the engine servers the run
    started."""

    def __init__(self, actors: list, engines: EngineServers | None = None):
        self.actors = actors
        self.engines = engines
        self.where: list[str] = [""] * len(actors)  # "(pid 123 on 10.0.0.2, node 1a2b3c4d)" per actor
        self.pids: list[int] = []  # each actor's process id as last seen: a new one is a restart by Ray
        self.restarts = 0  # rollout actors Ray restarted (the rollout_restarts metric)
        self.engine_restarts = 0  # engine server restarts (the engine_restarts metric)
        self.lost = ""  # a node left with some of these actors on it (Cluster's watchdog): no use waiting for them
        self._generation = 0  # bumped each time dead engine servers were restarted
        self._loads: list[tuple[object, int]] = []  # queued loads not yet seen to finish, with their generation

    @classmethod
    def start(cls, config: Config, model_path: str, run_dir, options: list[dict], paths: list[str]) -> RolloutFleet:
        """Start the engine servers (engines.start), then one rollout actor per entry of `options` (Ray options
        placing it in its bundle), actor j loading from `paths[j]`, without waiting for the actors (`locate`)."""
        engines, urls = None, list(config.engines.urls)
        if config.engines.start:  # the actors then front the servers' URLs, exactly as servers that already run
            engines = EngineServers.start(config, model_path, run_dir)
            urls = list(engines.urls)
        # max_task_retries=-1: a call caught by a restart is rerun on the restarted actor (a rollout then refuses with
        # StaleRevision until the fleet has loaded the current revision into it again).
        restarts = config.rollout.max_restarts
        remote = ray.remote(max_restarts=restarts, max_task_retries=-1 if restarts else 0)(RolloutActor)
        fleet = cls([], engines)
        try:
            n = config.rollout.num_actors  # actor j fronts urls[j::n]: every engine one actor
            fleet.actors = [remote.options(**options[j]).remote(config, paths[j], j, urls[j::n]) for j in range(n)]
        except BaseException:
            fleet.close()
            raise
        fleet.where = [""] * len(fleet.actors)
        return fleet

    def locate(self, nodes: list[str]) -> None:
        """Wait until every actor is up (actor j on node `nodes[j]`): where each runs, and its process id."""
        places = ray.get([a.where.remote() for a in self.actors])
        # "(pid N on IP)" plus the node id: several nodes may share an address (containers, a test cluster).
        self.where = [f"{p[:-1]}, node {node[:8]})" for p, node in zip(places, nodes, strict=True)]
        self.pids = ray.get([a.pid.remote() for a in self.actors])

    # ---- revisions ---------------------------------------------------------------------------------------------

    def load(self, rev: Revision) -> None:
        """Load `rev` into every actor and wait. Each actor fetches the bytes from the object store (learner rank 0's,
        no driver hop) and refuses bytes that do not hash to `rev.id`."""
        generation = self._generation
        futures = [actor.load_adapter.remote(rev.id, rev.ref) for actor in self.actors]
        for i, future in enumerate(futures):
            try:
                ray.get(future)
            except FAILURES as err:
                self._recover_from(err, generation)
                self._reload(i, rev)
        self._count_restarts()

    def queue_load(self, rev: Revision) -> None:
        """Queue the load of `rev` on every actor without waiting: after the rollouts already queued there, before
        the ones queued later. `check_loads` surfaces a load that failed."""
        self._loads += [(a.load_adapter.remote(rev.id, rev.ref), self._generation) for a in self.actors]

    def check_loads(self) -> None:
        """Raise the error of a queued load that finished with one (a hash mismatch). A load whose actor died, or
        whose engine died and was restarted, is left to the rollout queued after it: that actor does not hold the
        revision, so the rollout is refused (StaleRevision) and redone after a reload."""
        if not self._loads:
            return
        done = set(ray.wait([f for f, _ in self._loads], num_returns=len(self._loads), timeout=0)[0])
        finished = [x for x in self._loads if x[0] in done]
        self._loads = [x for x in self._loads if x[0] not in done]
        for future, generation in finished:
            try:
                ray.get(future)
            except FAILURES as err:
                self._recover_from(err, generation)

    # ---- rollouts -----------------------------------------------------------------------------------------------

    def submit_rollout(
        self, examples: list, seed: int, rev: Revision, evaluate: tuple[int, float] | None = None
    ) -> RolloutCall:
        """Spread the prompts over the actors (each group stays on one actor: shared prefix) and queue the calls
        without waiting. Shard i samples with seed `seed * 1000 + i`, whenever it runs. With `evaluate` = (samples,
        temperature) the calls are an eval pass instead, shard i seeded `seed + i`; `collect` recovers both alike."""
        n = len(self.actors)
        shards = [examples[i::n] for i in range(n)]
        call = RolloutCall(shards, seed, rev, {}, {}, evaluate, self._generation)
        call.futures = {i: self._shard_call(call, i) for i in range(n) if shards[i]}
        # The actor's pid, asked right behind the rollout: a restart shows as a new pid without waiting on the calls
        # queued after this one (a blocking pid() would wait for the next steps' rollouts too). Not behind an eval
        # pass: with rollouts queued ahead of it (max_staleness >= 1) its pid would be read before theirs, out of
        # order, and count one restart several times; the next rollout's pid shows the restart.
        if evaluate is None:
            call.pids = {i: self.actors[i].pid.remote() for i in call.futures}
        return call

    def _shard_call(self, call: RolloutCall, i: int):
        if call.evaluate is not None:
            samples, temperature = call.evaluate
            return self.actors[i].evaluate.remote(call.shards[i], samples, temperature, call.seed + i, call.revision.id)
        return self.actors[i].rollout.remote(call.shards[i], call.seed * 1000 + i, call.revision.id)

    def collect(self, call: RolloutCall, current: Revision | None = None) -> list:
        """Wait for a rollout: its groups (an eval pass: its reward lists), in the order of its prompts.

        A shard that failed (FAILURES) is redone once its actor holds the call's revision again, with the same seed.
        `current`: the newest revision; when it differs from the call's, it is loaded back into a redone actor
        afterwards, so the next steps sample with it.
        """
        results: list[list] = [[] for _ in self.actors]
        futures, redone = dict(call.futures), []
        for attempt in range(2):
            dead = []
            for i, future in futures.items():
                try:
                    results[i] = ray.get(future)
                except FAILURES as err:
                    if attempt == 1:
                        self._failed_again(i, err)
                    self._recover_from(err, call.generation)
                    dead.append(i)
            if not dead:
                break
            for i in dead:
                self._reload(i, call.revision)
            futures, redone = {i: self._shard_call(call, i) for i in dead}, dead
        if current is not None and current.id != call.revision.id:
            for i in redone:  # the reload above put an older revision back: the next steps sample with the newest
                self._reload(i, current)
        self._count_pids(call.pids)
        return [group for shard in results for group in shard]

    def _failed_again(self, i: int, err: BaseException) -> None:
        """A redone shard failed too: one line naming the dead engine server (when one died) or the actor."""
        if isinstance(err, EngineError):
            if self.engines is not None:
                self.engines.check()  # a dead engine server is the cause: name it and its log
            raise err
        raise MintError(f"rollout actor {i} died again after a restart; stopping") from err

    # ---- the one recovery path ----------------------------------------------------------------------------------

    def _recover_from(self, err: BaseException, generation: int) -> None:
        """Return when a call that failed with `err` (one of FAILURES) can be redone once its actor holds the call's
        revision again; raise when it cannot.

        EngineError: the engine servers that died are restarted (`_revive_engines`); when none was restarted since
        the call was made (`generation`), the error is the engine's answer, not its death, and is raised. An actor
        gone with its node (`lost`) is not waited for: one line, which the driver turns into a restart elsewhere."""
        if isinstance(err, EngineError):
            self._revive_engines()
            # A connection reset can reach us before the server's process has exited (a large process takes a
            # while to tear down on a loaded machine): give an unreachable engine time to be seen dead.
            deadline = time.monotonic() + DEATH_WAIT_S
            while isinstance(err, EngineUnreachable) and self._generation == generation and self.engines is not None:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
                self._revive_engines()
            if self._generation == generation:
                raise err
        elif isinstance(err, RayActorError) and self.lost:
            raise MintError(self.lost) from err

    def _reload(self, i: int, rev: Revision) -> None:
        """Load `rev` into actor i after Ray restarted it, or after it missed a load; the failures of the load itself
        go through `_recover_from` too. One line when the actor does not come back within RESTART_WAIT_S."""
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            generation = self._generation
            try:  # retried by Ray once the actor is back; raises when it is out of restarts
                ray.get(self.actors[i].load_adapter.remote(rev.id, rev.ref))
                return
            except FAILURES as err:
                self._recover_from(err, generation)
                if isinstance(err, RayActorError):
                    if time.monotonic() > deadline:
                        raise MintError(
                            f"rollout actor {i} {self.where[i]} died and did not come back".replace("  ", " ")
                        ) from err
                    time.sleep(1.0)

    def _revive_engines(self) -> None:
        """Restart every engine server of this run that died, then have every actor that fronts a restarted one load
        its current revision on it again. Until it has, a request there names an adapter the server does not hold
        and fails: no sample comes from an engine without the revision the call names. Raises one line for an
        engine out of restarts or whose actor is gone."""
        restarted = self.engines.restart_dead() if self.engines is not None else []
        for url, restarts in restarted:
            self.engine_restarts += restarts
            self._generation += 1
            calls = [actor.reinstall.remote(url) for actor in self.actors]
            for call in calls:
                try:
                    ray.get(call)
                except RayActorError:  # a dead rollout actor is loaded again when its work is redone
                    pass
                except RayTaskError as err:  # the new server refused the load, or died already
                    cause = " ".join(str(err.cause).split())  # one line, without Ray's traceback
                    raise MintError(
                        f"rollout engine at {url}: loading the revision again after its restart failed: {cause}"
                    ) from None

    # ---- restarts and the end -----------------------------------------------------------------------------------

    def _count_restarts(self) -> None:
        """Ray may restart a dead actor and rerun a call on it without the driver seeing an error (a load caught by
        the restart): count restarts by the actors' process ids instead."""
        pids = ray.get([actor.pid.remote() for actor in self.actors])
        self.restarts += sum(a != b for a, b in zip(pids, self.pids, strict=True))
        self.pids = pids

    def _count_pids(self, pids: dict[int, object]) -> None:
        """Count restarts from the pids asked behind a step's rollout calls (as _count_restarts, without blocking)."""
        for i, future in pids.items():
            try:
                pid = ray.get(future)
            except RayActorError:
                continue  # the rollout's own retry already dealt with (or reported) this actor
            if pid != self.pids[i]:
                self.restarts += 1
                self.pids[i] = pid

    def node_left(self, line: str, indices: list[int]) -> None:
        """The watchdog saw these actors' node leave: kill them, so every call waiting on them fails at once (Ray
        would otherwise wait forever to restart them on the node that is gone), and stop waiting for them."""
        self.lost = line
        for i in indices:
            ray.kill(self.actors[i], no_restart=True)

    def close(self) -> None:
        """Kill the actors, then stop the engine servers (each one's whole process group)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.engines is not None:
            self.engines.stop()
