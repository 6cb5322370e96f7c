"""The rollout pipeline: which steps' rollouts are in flight, with which revision, and how stale each step's samples
are (`rollout.max_staleness` = k).

    step t:  queue the rollouts of steps t .. min(t + k, stop) not yet queued, each with the newest revision
             -> wait for step t's samples -> the learner trains on them -> broadcast: the new revision's load is
             queued on every rollout actor behind the rollouts already queued there

An actor runs its calls one at a time in the order they were made (mint.train.rollout_fleet), so a load lands
between two steps' rollouts, never inside one. A rollout queued at step t samples with the revision after step
t - 1 and is learned at step t + j (j <= k) by a learner holding the revision after step t + j - 1: at most k
revisions behind. With k = 0 each step's rollout is queued and awaited with the revision the learner holds, and
each load is awaited: the on-policy loop, call for call.

`stop`: nothing is queued past the next checkpoint step (a multiple of checkpoint.every) or the last step, so no
rollout is in flight when a checkpoint is written. The revision each step samples with is then a function of the
step, k and checkpoint.every alone, and a run resumed from a periodic checkpoint samples every later step with the
same revisions as the run that was not stopped. The price is one step without overlap after each checkpoint.

Begin ahead: with k >= 1 the next step's rollout is usually queued already when step t's learning is done, so the
driver can collect its samples and queue its learning before it publishes step t's revision. The driver asks
(`in_flight`, `collect`); after the publish, `queue_ahead` queues the rollouts beyond that step, which sample with
the revision just published.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from mint.config import Config
from mint.errors import MintError
from mint.train.rollout_fleet import RolloutCall, RolloutFleet
from mint.train.step import Revision


def queue_limit(step: int, max_staleness: int, steps: int, checkpoint_every: int) -> int:
    """The last step whose rollout may be in flight while the learner works on `step`: step + k, but never past the
    next checkpoint step (multiples of checkpoint_every; 0 = none) or the run's last step."""
    stop = steps
    if checkpoint_every:
        stop = min(stop, -(-step // checkpoint_every) * checkpoint_every)
    return min(step + max_staleness, stop)


class RolloutPipeline:
    """Rollouts queued ahead of the learner, and the revisions they sample with."""

    def __init__(self, fleet: RolloutFleet, config: Config, stream: Iterator, rev: Revision, done: int):
        """`stream`: the data batches from step done + 1 on; `rev`: the revision the actors hold."""
        self.fleet, self.config, self.stream = fleet, config, stream
        self.k = config.rollout.max_staleness
        self._queued = done  # the last step whose rollout was queued
        self._collected = done  # the last step whose samples were collected
        self._calls: deque[tuple[int, RolloutCall]] = deque()
        self._newest = rev
        self._version = {rev.id: 0}  # revision id -> how many revisions this pipeline has broadcast before it

    def samples(self, step: int) -> list:
        """Queue the rollouts the bound allows, then wait for step `step`'s: its groups (GroupResult)."""
        self._queue(step)
        return self.collect(step)

    def in_flight(self, step: int) -> bool:
        """Whether step `step`'s rollout is queued already: with k >= 1 the next step's usually is, and it can be
        begun (`collect`) while the driver publishes the step before it."""
        return any(queued == step for queued, _ in self._calls)

    def collect(self, step: int) -> list:
        """Wait for the rollout of step `step`, queued earlier: its groups (GroupResult)."""
        if not self._calls:
            raise MintError(f"rollout pipeline: asked for step {step} with no rollout in flight")
        queued_step, call = self._calls.popleft()
        if queued_step != step:  # the loop asks for the steps in order; anything else is a bug here
            raise MintError(f"rollout pipeline: asked for step {step}, the next in flight is step {queued_step}")
        results = self.fleet.collect(call, self._newest)
        self.fleet.check_loads()
        self._collected = step
        return results

    def broadcast(self, rev: Revision) -> None:
        """Hand a newly admitted revision to the rollout fleet; the rollouts queued from now on sample with it.
        On-policy (k = 0) every actor has loaded it when this returns; with k >= 1 its load is queued behind the
        rollouts in flight and the driver goes on."""
        if self.k == 0:
            self.fleet.load(rev)
        else:
            self.fleet.queue_load(rev)
        if rev.id != self._newest.id:
            self._version[rev.id] = len(self._version)
            self._newest = rev

    def queue_ahead(self) -> None:
        """After a step's publish (or skip): when the next step was begun ahead, queue the rollouts beyond it that its
        bound allows, with the newest revision; otherwise nothing is due before the next step's own turn."""
        self._queue(self._collected)

    def _queue(self, step: int) -> None:
        """Queue the rollouts of the steps up to `step`'s bound (queue_limit), each with the newest revision."""
        c = self.config
        limit = queue_limit(step, self.k, c.grpo.steps, c.checkpoint.every)
        while self._queued < limit:
            self._queued += 1
            examples = next(self.stream)
            call = self.fleet.submit_rollout(examples, c.grpo.seed + self._queued, self._newest)
            self._calls.append((self._queued, call))

    def staleness(self, results: list) -> dict[str, float]:
        """How many revisions the step's samples are behind the one the learner trained them with (mean, max)."""
        now = self._version[self._newest.id]
        behind = [now - self._version[r.revision] for r in results if r.revision in self._version]
        if not behind:
            return {}
        return {"staleness_mean": sum(behind) / len(behind), "staleness_max": max(behind)}
