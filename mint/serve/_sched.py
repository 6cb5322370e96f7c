"""Admission and batching: a bounded queue of jobs and one decode worker thread.

    submit   a job enters the queue, or is refused at once (429) when `max_queue` jobs are already waiting
    worker   takes the oldest job's revision, waits `batch_wait_s` for a burst to gather, admits every queued job of
             that revision (up to `max_batch` jobs in the batch), and decodes them together (`BatchDecoder`). Between
             steps it admits more jobs of the same revision while the oldest waiting job is one of them; when the
             oldest is for another revision, or an adapter change is waiting, it admits nothing and lets the batch
             drain, so no job waits behind more than one batch of another revision.

With `max_batch = 1` jobs run one at a time (the serial baseline of bench/serve_load.py). A job past its deadline, or
whose client went away, leaves the batch at the next step. An exception inside a step fails the jobs of that batch
with a 500 (its traceback logged) and the worker carries on with a fresh batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from mint.serve._api import HttpError
from mint.serve._decode import BatchDecoder, Job
from mint.serve._model import AdapterHost

log = logging.getLogger("mint.serve")


class Scheduler:
    def __init__(self, host: AdapterHost, *, max_batch: int = 64, max_queue: int = 256, batch_wait_s: float = 0.002):
        self.host = host
        self.max_batch = max_batch if host.batchable else 1
        self.max_queue = max_queue
        self.batch_wait_s = batch_wait_s
        self.queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self.stats = dict(batches=0, steps=0, max_batch_seen=0, refused=0)
        self._thread = threading.Thread(target=self._run, name="mint-decode", daemon=True)
        self._thread.start()

    # ---- the HTTP side ------------------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                raise HttpError(503, "the server is shutting down")
            if len(self.queue) >= self.max_queue:
                self.stats["refused"] += 1
                raise HttpError(429, f"the queue is full ({self.max_queue} requests waiting); retry later")
            self.queue.append(job)
            self._cv.notify_all()

    def cancel(self, job: Job) -> None:
        """The client left or its deadline passed: forget the job (the worker drops it if it is decoding)."""
        job.cancelled = True
        with self._cv:
            if job in self.queue:
                self.queue.remove(job)

    def waiting(self) -> int:
        return len(self.queue)

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            pending = list(self.queue)
            self.queue.clear()
            self._cv.notify_all()
        for job in pending:
            job.emit(("error", HttpError(503, "the server is shutting down")))

    # ---- the worker ---------------------------------------------------------------------------------------------

    def _take(self, rid: str | None, room: int, only_head: bool) -> list[Job]:
        """Queued jobs for revision `rid`, oldest first, at most `room`; with `only_head`, only while the oldest
        queued job is one of them."""
        taken: list[Job] = []
        with self._cv:
            if self.host.writers_waiting:
                return taken
            if only_head:
                while self.queue and len(taken) < room and self.queue[0].revision == rid:
                    taken.append(self.queue.popleft())
            else:
                for job in list(self.queue):
                    if len(taken) >= room:
                        break
                    if job.revision == rid:
                        self.queue.remove(job)
                        taken.append(job)
        return taken

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self.queue or self._stopping)
                if self._stopping:
                    return
            if self.batch_wait_s > 0:
                time.sleep(self.batch_wait_s)  # let a burst arrive, so it shares the first steps
            self.host.wait_for_writers()
            with self.host.lock:
                with self._cv:
                    if not self.queue:
                        continue
                    rid = self.queue[0].revision
                first = self._take(rid, self.max_batch, only_head=False)
                try:
                    with self.host.activate(rid) as model:
                        self._batch(model, rid, first)
                except HttpError as err:  # the revision went away while its jobs waited
                    for job in first:
                        job.emit(("error", err))

    def _batch(self, model, rid: str | None, jobs: list[Job]) -> None:
        self.stats["batches"] += 1
        decoder = BatchDecoder(model, self.host.eos_ids, self.host.tokenizer)
        with decoder:
            try:
                self._admit(decoder, jobs)
                while not decoder.empty:
                    self._expire(decoder)
                    if decoder.empty:
                        break
                    decoder.step()
                    self.stats["steps"] += 1
                    room = self.max_batch - len(decoder.jobs)
                    if room > 0:
                        self._admit(decoder, self._take(rid, room, only_head=True))
            except Exception:
                log.exception("decode step failed; failing the %d requests in the batch", len(decoder.jobs))
                for job in decoder.active_jobs():
                    job.emit(("error", HttpError(500, "internal error while decoding (logged on the server)")))

    def _admit(self, decoder: BatchDecoder, jobs: list[Job]) -> None:
        for job in jobs:
            if job.cancelled:
                continue
            try:
                decoder.admit(job)
            except Exception:
                log.exception("prefill failed")
                job.emit(("error", HttpError(500, "internal error in prefill (logged on the server)")))
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(decoder.jobs))

    def _expire(self, decoder: BatchDecoder) -> None:
        now = time.monotonic()
        for job in decoder.active_jobs():
            if job.cancelled or now > job.deadline:
                decoder.drop(job)
                if not job.cancelled:
                    job.emit(("error", HttpError(504, "request timed out while decoding")))
