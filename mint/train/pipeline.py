"""The rollout pipeline: which steps' rollouts are in flight, with which revision, and how stale each step's samples
are (`rollout.max_staleness` = k).

    step t:  queue the rollouts of steps t .. min(t + k, stop) not yet queued, each with the newest revision
             -> wait for step t's samples -> the learner trains on them -> publish: the new revision's load is
             queued on every rollout actor behind the rollouts already queued there

An actor runs its calls one at a time in the order they were made (mint.train.cluster.submit_loads), so a load
lands between two steps' rollouts, never inside one. A rollout queued at step t samples with the revision after step
t - 1 and is learned at step t + j (j <= k) by a learner holding the revision after step t + j - 1: at most k
revisions behind. With k = 0 each step's rollout is queued and awaited with the revision the learner holds, and
each load is awaited: the on-policy loop, call for call.

`stop`: nothing is queued past the next checkpoint step (a multiple of checkpoint.every) or the last step, so no
rollout is in flight when a checkpoint is written. The revision each step samples with is then a function of the
step, k and checkpoint.every alone, and a run resumed from a periodic checkpoint samples every later step with the
same revisions as the run that was not stopped. The price is one step without overlap after each checkpoint.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

import ray

from mint.config import Config
from mint.errors import MintError
from mint.rollout.backends import EngineError
from mint.train.cluster import (
    ACTOR_GONE,
    Cluster,
    RolloutCall,
    collect_rollout,
    load_revision,
    submit_loads,
    submit_rollout,
)
from mint.train.engines import revive_engines


def queue_limit(step: int, max_staleness: int, steps: int, checkpoint_every: int) -> int:
    """The last step whose rollout may be in flight while the learner works on `step`: step + k, but never past the
    next checkpoint step (multiples of checkpoint_every; 0 = none) or the run's last step."""
    stop = steps
    if checkpoint_every:
        stop = min(stop, -(-step // checkpoint_every) * checkpoint_every)
    return min(step + max_staleness, stop)


class RolloutPipeline:
    """Rollouts queued ahead of the learner, and the revisions they sample with."""

    def __init__(self, cluster: Cluster, config: Config, stream: Iterator, rev_id: str, data_ref, done: int):
        """`stream`: the data batches from step done + 1 on; `rev_id` / `data_ref`: the revision the actors hold."""
        self.cluster, self.config, self.stream = cluster, config, stream
        self.k = config.rollout.max_staleness
        self.queued = done  # the last step whose rollout was queued
        self.in_flight: deque[tuple[int, RolloutCall]] = deque()
        self.newest = (rev_id, data_ref)
        self.version = {rev_id: 0}  # revision id -> how many revisions this pipeline has loaded before it
        self.loads: list = []  # revision loads queued on the actors and not yet seen to finish

    def samples(self, step: int) -> list:
        """Queue the rollouts the bound allows, then wait for step `step`'s: its groups (GroupResult)."""
        self.queue(step)
        return self.collect(step)

    def queue(self, step: int) -> None:
        """Queue the rollouts of the steps up to `step`'s bound (queue_limit), each with the newest revision."""
        c = self.config
        limit = queue_limit(step, self.k, c.grpo.steps, c.checkpoint.every)
        while self.queued < limit:
            self.queued += 1
            examples = next(self.stream)
            call = submit_rollout(self.cluster, examples, c.grpo.seed + self.queued, *self.newest)
            self.in_flight.append((self.queued, call))

    def collect(self, step: int) -> list:
        """Wait for the rollout of step `step`, queued earlier: its groups (GroupResult)."""
        if not self.in_flight:
            raise MintError(f"rollout pipeline: asked for step {step} with no rollout in flight")
        queued_step, call = self.in_flight.popleft()
        if queued_step != step:  # the loop asks for the steps in order; anything else is a bug here
            raise MintError(f"rollout pipeline: asked for step {step}, the next in flight is step {queued_step}")
        results = collect_rollout(self.cluster, call, self.newest)
        self._check_loads()
        return results

    def loader(self) -> Callable[[Cluster, str, object], None]:
        """publish's `load`: on-policy the default, which waits until every actor holds the new revision; with
        k >= 1 the loads are queued behind the rollouts in flight and the driver goes on."""
        return load_revision if self.k == 0 else self._queue_load

    def _queue_load(self, cluster: Cluster, rev_id: str, data_ref) -> None:
        self.loads += [(future, cluster.engine_restarts) for future in submit_loads(cluster, rev_id, data_ref)]

    def advance(self, rev_id: str, data_ref) -> None:
        """After a publish: the next rollouts sample with `rev_id` (`data_ref`: its bytes in the object store)."""
        if rev_id == self.newest[0]:
            return
        self.version[rev_id] = len(self.version)
        self.newest = (rev_id, data_ref)

    def staleness(self, results: list) -> dict[str, float]:
        """How many revisions the step's samples are behind the one the learner trained them with (mean, max)."""
        now = self.version[self.newest[0]]
        behind = [now - self.version[r.revision] for r in results if r.revision in self.version]
        if not behind:
            return {}
        return {"staleness_mean": sum(behind) / len(behind), "staleness_max": max(behind)}

    def _check_loads(self) -> None:
        """Surface the error of a queued load that failed (a hash mismatch); a dead actor is the rollout's business:
        its next rollout is refused (StaleRevision) and redone after a reload. So is a load that failed on an engine
        server that died: once the server is restarted (revive_engines, now or since the load was queued), the
        actor still holds the older revision, and its next rollout is refused and redone the same way."""
        if not self.loads:
            return
        done = set(ray.wait([f for f, _ in self.loads], num_returns=len(self.loads), timeout=0)[0])
        finished, self.loads = [x for x in self.loads if x[0] in done], [x for x in self.loads if x[0] not in done]
        for future, restarts_then in finished:
            try:
                ray.get(future)
            except ACTOR_GONE:
                pass
            except EngineError:
                if not revive_engines(self.cluster) and self.cluster.engine_restarts == restarts_then:
                    raise
