"""The engine's scheduler on a background thread, fed by HTTP handlers.

The engine is single-threaded; this thread is the only one that touches it. Every iteration takes
new jobs and aborts from the inbox, runs at most one call (scoring an echoed prompt, publishing a
document: each can be a long prefill, so several in a row would stall every stream), runs one
`Scheduler.step()` (admission, one batched forward step, finished requests handed to the cache),
and sends each job the text that became safe to show. Results reach the asyncio side through each job's `emit`, a thread-safe callback.
Detokenization happens here (incrementally, in the engine), never on the event loop.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from irminsul.engine.engine import Engine
from irminsul.engine.sampling import SamplingParams
from irminsul.engine.scheduler import Scheduler
from irminsul.engine.sequence import RequestStats, Sequence, TokenLogprob
from irminsul.errors import RequestError

log = logging.getLogger("irminsul.server")
_ids = itertools.count(1)


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens generated since the last event (when asked for)


@dataclass(frozen=True)
class Finished:
    text: str  # the whole output (stop strings cut)
    finish_reason: str
    stats: RequestStats
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None  # every generated token's, when asked for


@dataclass(frozen=True)
class Failed:
    status: int
    message: str


Event = Delta | Finished | Failed


@dataclass(eq=False)
class Job:
    tokens: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    segment_starts: list[int] | None = None
    tenant: str | None = None
    matcher: object | None = None  # the output constraint's grammar state, compiled off the engine thread
    leader: Job | None = None  # the first choice of the same prompt (n > 1): its prompt rows are shared
    # Finished -> the finish reason its client is sent, when the server's differs from the engine's
    # (tool_calls): /metrics counts what clients see
    shown_reason: Callable[[Finished], str] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    seq: Sequence | None = None
    last_token_at: float | None = None
    logprobs_sent: int = 0


class QueueFull(Exception):
    pass


class EngineRunner:
    def __init__(self, engine: Engine, max_running_requests: int, max_queued_requests: int, metrics=None):
        self.engine, self.metrics = engine, metrics
        self.scheduler = Scheduler(engine, max_running_requests, on_admit=self._admitted)
        self.max_queued_requests = max_queued_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: collections.deque = collections.deque()  # (future, fn, args) taken from the inbox, not yet run
        self._jobs: dict[int, Job] = {}  # sequence id -> job, for every job the scheduler holds
        self._admitted_ids: set[int] = set()  # jobs admitted at least once (no longer counted as queued)
        self._submitted = 0  # jobs handed in and not yet admitted or dropped (for the queue limit)
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="irminsul-engine", daemon=True)
        self.stats = self.scheduler.stats()  # the latest snapshot, for /metrics

    async def refresh_stats(self, timeout: float = 5.0) -> dict:
        """A fresh snapshot of the scheduler's stats, taken on the engine thread between steps (the
        last one if the thread does not answer in time)."""
        import asyncio

        try:
            self.stats = await asyncio.wait_for(asyncio.wrap_future(self.call(self.scheduler.stats)), timeout)
        except asyncio.TimeoutError:
            pass
        return self.stats

    # -- any thread ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        return self._submitted

    def submit(self, job: Job) -> None:
        with self._count_lock:
            if self._submitted >= self.max_queued_requests:
                raise QueueFull(f"{self._submitted} requests are already queued (--max-queued-requests)")
            self._submitted += 1
        self._inbox.put(("job", job))

    def prefetch(self, job: Job) -> None:
        """Read the job's cached chunks from the disk and Redis tiers (call from a worker thread, not
        the engine's): admission then finds them staged instead of waiting on I/O."""
        try:
            self.engine.cache.prefetch(job.tokens, job.segment_starts, job.tenant)
        except Exception:  # a store problem costs reuse, never the request
            log.exception("prefetching request %d's chunks failed", job.id)

    def _dequeued(self) -> None:
        with self._count_lock:
            self._submitted -= 1

    def abort(self, job: Job) -> None:
        self._inbox.put(("abort", job))

    def call(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the engine thread, between steps (e.g. publishing chunks); while
        sequences run, one call per step."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (future, fn, args)))
        return future

    # -- the engine thread ---------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not self.scheduler.has_work and not self._calls)
                if self._calls:
                    self._run(*self._calls.popleft())
                if self.scheduler.has_work:
                    self._step()
            except Exception:  # a bug must cost the requests it touches, never the thread
                log.exception("the engine loop hit an unexpected error; it keeps serving")

    def _drain(self, block: bool) -> None:
        try:
            kind, item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if kind == "job":
                self._accept(item)
            elif kind == "abort":
                self._abort(item)
            elif kind == "call":
                self._calls.append(item)
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _run(future: concurrent.futures.Future, fn: Callable, args: tuple) -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the awaiting request
                future.set_exception(e)

    def _accept(self, job: Job) -> None:
        try:
            lead = job.leader.seq if job.leader is not None else None  # None if the leader was refused
            job.seq = self.engine.new_sequence(job.tokens, job.params, job.segment_starts, tenant=job.tenant,
                                               matcher=job.matcher, leader=lead)
        except Exception as e:  # NOTE: nothing a request sends may stop this thread
            self._dequeued()
            if isinstance(e, RequestError):
                job.emit(Failed(400, str(e)))
            else:
                log.exception("accepting request %d failed", job.id)
                job.emit(Failed(500, f"internal error while accepting the request: {e}"))
            return
        self._jobs[job.seq.id] = job
        self.scheduler.add(job.seq)

    def _admitted(self, seq: Sequence) -> None:
        if seq.id not in self._admitted_ids:  # the first admission, not a re-admission after preemption
            self._admitted_ids.add(seq.id)
            self._dequeued()
            if self.metrics:
                self.metrics.admitted(seq.stats)

    def _step(self) -> None:
        try:
            outputs = self.scheduler.step()
        except Exception as e:
            log.exception("engine step failed; failing the %d running requests", len(self.scheduler.running))
            for seq in list(self.scheduler.running):
                self.scheduler.abort(seq)
                self._admitted_ids.discard(seq.id)
                self._end(self._jobs.pop(seq.id), Failed(500, f"internal error during generation: {e}"))
            return
        now = time.monotonic()
        for out in outputs:
            job = self._jobs.get(out.seq.id)
            if job is None:
                continue
            if out.token is not None and self.metrics:
                if job.last_token_at is None:
                    self.metrics.ttft(now - job.arrival)
                else:
                    self.metrics.inter_token(now - job.last_token_at)
            if out.token is not None:
                job.last_token_at = now
            if out.seq.error is not None:
                if out.seq.id in self._admitted_ids:  # failed while running: a bug (500), this request only,
                    # or its own doing (a constraint that reached a dead end: 400)
                    self._end(self._jobs.pop(out.seq.id), Failed(out.seq.error_status, out.seq.error))
                else:  # refused at admission: it can never fit
                    self._dequeued()
                    self._end(self._jobs.pop(out.seq.id), Failed(400, out.seq.error))
                self._admitted_ids.discard(out.seq.id)
                continue
            fresh = tuple(out.seq.logprobs[job.logprobs_sent:])
            job.logprobs_sent += len(fresh)
            if out.text or fresh:
                job.emit(Delta(out.text, fresh))
            if out.finished:
                self._admitted_ids.discard(out.seq.id)
                seq = self._jobs.pop(out.seq.id).seq
                finished = Finished(seq.text, seq.finish_reason, seq.stats, len(seq.output_ids),
                                    tuple(seq.logprobs) if seq.params.logprobs is not None else None)
                job.emit(finished)
                if self.metrics:
                    self.metrics.finished(self._shown_reason(job, finished), len(seq.output_ids), now=now,
                                          arrival=job.arrival)

    @staticmethod
    def _shown_reason(job: Job, finished: Finished) -> str:
        """The finish reason the client is sent (for /metrics); a failure to tell costs only the label."""
        if job.shown_reason is None:
            return finished.finish_reason
        try:
            return job.shown_reason(finished)
        except Exception:
            log.exception("request %d: reading its finish reason failed", job.id)
            return finished.finish_reason

    def _end(self, job: Job, event: Failed) -> None:
        job.emit(event)
        if self.metrics:
            self.metrics.finished("abort", len(job.seq.output_ids), now=time.monotonic(), arrival=job.arrival)

    def _abort(self, job: Job) -> None:
        if job.seq is None or job.seq.id not in self._jobs:
            return  # never accepted, or already done
        if job.seq in self.scheduler.waiting:
            self._dequeued()
        self.scheduler.abort(job.seq)
        del self._jobs[job.seq.id]
        self._admitted_ids.discard(job.seq.id)
        if self.metrics:
            self.metrics.finished("abort", len(job.seq.output_ids), now=time.monotonic(), arrival=job.arrival)
