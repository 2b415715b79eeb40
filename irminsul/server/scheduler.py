"""Continuous batching on a background thread (in the spirit of nano-vllm's and mini-sglang's schedulers).

The engine is single-threaded; this thread is the only one that touches it. Every iteration:

1. take new jobs, aborts and calls from the inbox;
2. admit waiting jobs in arrival order while their rows fit the token budget
   (``prompt + max_tokens`` per job, at most ``max_running_tokens`` in all) and the running cap;
   admission plans the prompt against the cache and copies reused rows in (``engine.add``);
3. run ONE ``engine.step`` over every running sequence: prefill chunks (at most
   ``max_prefill_tokens`` per step, so a long prompt never stalls the decodes) together with one
   decode token for each sequence already past its prompt;
4. stream each new token's text to its job and finish the sequences that are done.

Results reach the asyncio side through ``emit``, a thread-safe callback. An aborted job (client
gone) is finished with ``engine.finish`` so its pins are released and its rows freed.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from irminsul.engine.engine import Engine
from irminsul.engine.sampling import SamplingParams
from irminsul.engine.sequence import RequestStats, Sequence
from irminsul.errors import RequestError

log = logging.getLogger("irminsul.server")
_ids = itertools.count(1)


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Finished:
    text: str  # the whole output (stop strings cut)
    finish_reason: str
    stats: RequestStats
    completion_tokens: int


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
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    seq: Sequence | None = None
    sent: int = 0  # characters of output text already streamed
    last_token_at: float | None = None

    @property
    def cost(self) -> int:
        """Latent rows this job holds while running."""
        return len(self.tokens) + self.params.max_tokens


class QueueFull(Exception):
    pass


class Scheduler:
    def __init__(self, engine: Engine, max_running_tokens: int, max_running_requests: int,
                 max_queued_requests: int, metrics=None):
        self.engine, self.metrics = engine, metrics
        self.max_running_tokens, self.max_running_requests = max_running_tokens, max_running_requests
        self.max_queued_requests = max_queued_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.running_tokens = self.peak_running_tokens = 0
        self._submitted = 0  # jobs handed in and not yet admitted or dropped (for the queue limit)
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="irminsul-scheduler", daemon=True)

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

    def _dequeued(self) -> None:
        with self._count_lock:
            self._submitted -= 1

    def abort(self, job: Job) -> None:
        self._inbox.put(("abort", job))

    def call(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the scheduler thread, between steps (e.g. publishing chunks)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (future, fn, args)))
        return future

    # -- the scheduler thread ------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.running and not self.waiting)
            self._admit()
            if self.running:
                self._step()

    def _drain(self, block: bool) -> None:
        try:
            kind, item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if kind == "job":
                self.waiting.append(item)
            elif kind == "abort":
                self._abort(item)
            elif kind == "call":
                future, fn, args = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as e:  # handed to the awaiting request
                        future.set_exception(e)
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running_requests:
            job = self.waiting[0]
            if self.running and self.running_tokens + job.cost > self.max_running_tokens:
                return  # NOTE: strict arrival order, so a large request is never starved by small ones
            self.waiting.popleft()
            self._dequeued()
            try:
                job.seq = self.engine.add(job.tokens, job.params, job.segment_starts, tenant=job.tenant)
            except RequestError as e:
                job.emit(Failed(400, str(e)))
                continue
            except Exception as e:  # a bug or a broken store: fail this request, keep serving
                log.exception("admitting request %d failed", job.id)
                job.emit(Failed(500, f"internal error while admitting the request: {e}"))
                continue
            self.running.append(job)
            self.running_tokens += job.cost
            self.peak_running_tokens = max(self.peak_running_tokens, self.running_tokens)
            if self.metrics:
                self.metrics.admitted(job.seq.stats)

    def _step(self) -> None:
        seqs = [job.seq for job in self.running]
        try:
            new = self.engine.step(seqs)
        except Exception as e:
            log.exception("engine step failed; failing the %d running requests", len(seqs))
            for job in list(self.running):
                self._release(job)
                job.emit(Failed(500, f"internal error during generation: {e}"))
            return
        now = time.monotonic()
        for job, token in zip(list(self.running), new):
            if token is not None and self.metrics:
                if job.last_token_at is None:
                    self.metrics.ttft(now - job.arrival)
                else:
                    self.metrics.inter_token(now - job.last_token_at)
            if token is not None:
                job.last_token_at = now
            if job.seq.finished:
                self._finish(job)
            elif token is not None:
                self._stream(job)

    def _stream(self, job: Job) -> None:
        text = self.engine.output_text(job.seq)
        safe = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 sequence waits for its next bytes
        if job.params.stop:  # never show the start of what may become a stop string
            safe = min(safe, len(text) - max(len(s) for s in job.params.stop) + 1)
        if safe > job.sent:
            job.emit(Delta(text[job.sent:safe]))
            job.sent = safe

    def _finish(self, job: Job) -> None:
        seq = job.seq
        text = self.engine.output_text(seq)
        self._release(job)
        if len(text) > job.sent:
            job.emit(Delta(text[job.sent:]))
        job.emit(Finished(text, seq.finish_reason, seq.stats, len(seq.output_ids)))
        if self.metrics:
            self.metrics.finished(seq.finish_reason, len(seq.output_ids), now=time.monotonic(), arrival=job.arrival)

    def _release(self, job: Job) -> None:
        """Remove a running job and hand its sequence back to the engine (exactly once)."""
        self.running.remove(job)
        self.running_tokens -= job.cost
        try:
            self.engine.finish(job.seq)
        except Exception:
            log.exception("finishing request %d failed", job.id)

    def _abort(self, job: Job) -> None:
        if job in self.waiting:
            self.waiting.remove(job)
            self._dequeued()
        elif job in self.running:
            self._release(job)
            if self.metrics:
                self.metrics.finished("abort", len(job.seq.output_ids), now=time.monotonic(), arrival=job.arrival)
