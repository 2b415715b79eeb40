"""The server's one way to the engine: its scheduler on a background thread, and named calls for the handlers.

The engine is single-threaded; this thread is the only one that touches its state. Every
iteration takes new jobs and aborts from the inbox, runs at most one call (scoring an echoed
prompt, publishing a document, a stats snapshot: each can be a long prefill, so several in a row
would stall every stream), runs one `Scheduler.step()` (admission, one batched forward step,
finished requests handed to the cache), and sends each job the text that became safe to show.
Results reach the asyncio side through each job's `emit`, a thread-safe callback. Detokenization
happens here (incrementally, in the engine), never on the event loop.

Every engine, scheduler, pool and cache call the server makes is in this file. Handlers call the
client's methods: `validate`, `fits`, `matcher` and `prefetch` from worker threads (they read
nothing the engine thread mutates, or, for `prefetch`, only the store's own locked tiers);
`submit`, `abort`, `score`, `publish` and `refresh_stats` from anywhere (they go through the
inbox); `stats` is the snapshot the engine thread last took.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from irminsul.engine.build import build_engine, default_kv_cache_gib
from irminsul.engine.config import EngineConfig
from irminsul.engine.engine import Engine, PoolBusy, ScoringCancelled
from irminsul.engine.sampling import SamplingParams
from irminsul.engine.sequence import RequestStats, Sequence, TokenLogprob
from irminsul.errors import RequestError
from irminsul.kvcache.config import KVCacheConfig
from irminsul.kvcache.store import TierStats, tier_stats

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


def unsubmitted(event: Event) -> None:
    """A job's `emit` until it is submitted (`OpenAIServing.submit` gives it its channel's)."""
    raise RuntimeError(f"an event for a job that was not submitted: {event!r}")


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
    gone: threading.Event = field(default_factory=threading.Event)  # set by abort: its client went away


class QueueFull(Exception):
    """More jobs are queued than --max-queued-requests allows (a 429: a retry may succeed)."""


class Busy(Exception):
    """The KV pool has no room for the call now, while running requests hold theirs (a 503)."""


class PrefixCacheStats(NamedTuple):
    bytes: int
    budget_bytes: int
    nodes: int


@dataclass(frozen=True)
class EngineStats:
    """The pool, the queue and the caches, as the engine thread saw them between two steps."""

    kv_pool_bytes_used: int
    kv_pool_bytes_capacity: int
    cached_bytes: int  # pool bytes the prefix tree and the chunk registry hold (counted once)
    running_sequences: int
    waiting_sequences: int
    tiers: tuple[TierStats, ...] = ()  # the store's tiers (none with reuse=off)
    prefix_cache: PrefixCacheStats | None = None  # the radix tree (none with reuse=off)


class Published(NamedTuple):
    """What publishing a document stored: chunk entries and their tokens, and what it left out."""

    entries: int
    tokens: int
    skipped: int
    rejected: int


class EngineClient:
    def __init__(self, engine: Engine, max_queued_requests: int, metrics=None, registry=None):
        """`registry`: the chunk store the engine's cache was built over (closed with the client)."""
        self.engine, self.metrics, self.registry = engine, metrics, registry
        engine.on_admit(self._admitted)
        self.max_queued_requests = max_queued_requests
        self.reuse: str = engine.reuse  # the reuse mode (off, prefix, naive, pic)
        self.vocab_size: int = engine.config.vocab_size
        self.context: int = engine.config.max_position_embeddings
        self.kv_rows: int = engine.kv_rows  # the most rows one request can hold
        # disk / Redis tiers to read ahead of admission
        self._prefetches = registry is not None and bool(registry.lower)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: collections.deque = collections.deque()  # (future, fn, args) taken from the inbox, not yet run
        self._jobs: dict[int, Job] = {}  # sequence id -> job, for every job the scheduler holds
        self._admitted_ids: set[int] = set()  # jobs admitted at least once (no longer counted as queued)
        self._submitted = 0  # jobs handed in and not yet admitted or dropped (for the queue limit)
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="irminsul-engine", daemon=True)
        self.stats = self._snapshot()  # the latest snapshot, for /metrics

    @classmethod
    def create(cls, model, tokenizer, model_id: str, config, metrics=None) -> EngineClient:
        """The engine over a loaded model, with its chunk store and pool sized by the server's `config`."""
        from irminsul.kvcache.store import RowLayout, open_registry

        layout = RowLayout.of(model, model_id, secret=(config.store_secret or "").encode())
        pool_gib = config.kv_cache_gib if config.kv_cache_gib is not None else default_kv_cache_gib(model.device)
        registry = (
            open_registry(config.store, layout, memory_bytes=int(pool_gib * 2**30)) if config.reuse != "off" else None
        )
        for tier in registry.lower if registry is not None else ():
            if not tier.available:  # (it reconnects by itself; say so once)
                log.warning(
                    "the store tier %s does not answer; serving without it until it does "
                    "(/metrics: irminsul_store_available)",
                    tier.location,
                )
        try:
            engine = build_engine(cls.engine_config(config, model_id, pool_gib), model, tokenizer, registry=registry)
        except BaseException:
            if registry is not None:
                registry.close()
            raise
        return cls(engine, config.max_queued_requests, metrics, registry)

    @staticmethod
    def engine_config(config, model_id: str, kv_cache_gib: float | None = None) -> EngineConfig:
        """The engine's options from the server's `config` (a ServerConfig); `kv_cache_gib`: the pool
        size decided (the config's, or the device's default)."""
        cache = KVCacheConfig(config.reuse, model_id=model_id, tenant_share=config.tenant_cache_share or None)
        return EngineConfig(
            cache,
            max_prefill_tokens=config.max_prefill_tokens,
            kv_cache_gib=config.kv_cache_gib if kv_cache_gib is None else kv_cache_gib,
            compile_decode=config.compile_decode,
            max_running_requests=config.max_running_requests,
        )

    # -- any thread ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread, then the store's threads."""
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(30)
        if self.registry is not None:
            self.registry.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        return self._submitted

    def validate(self, tokens: list[int], room: int = 1) -> None:
        """Token ids in the vocabulary, and `room` positions left in the context after them; a
        RequestError that says which is not (pure: any thread)."""
        self.engine.validate_prompt(tokens, room)

    def fits(self, n_tokens: int) -> bool:
        """Whether one request of `n_tokens` rows (prompt + output) fits the KV pool at all."""
        return n_tokens <= self.kv_rows

    def matcher(self, constraint, tenant: str | None = None):
        """A fresh grammar state for a structured-output constraint (compiled on the caller's thread:
        a worker's, never the engine's, once per tenant while it is recent); a ValueError when the
        constraint cannot be compiled."""
        return self.engine.grammars.matcher(constraint, tenant)

    def submit(self, job: Job) -> None:
        with self._count_lock:
            if self._submitted >= self.max_queued_requests:
                raise QueueFull(f"{self._submitted} requests are already queued (--max-queued-requests)")
            self._submitted += 1
        self._inbox.put(("job", job))

    async def prefetch(self, job: Job) -> None:
        """Read the job's cached chunks from the disk and Redis tiers on a worker thread (the store's
        tiers lock themselves): admission then finds them staged instead of waiting on I/O."""
        if self._prefetches:
            await asyncio.to_thread(self._prefetch, job)

    def _prefetch(self, job: Job) -> None:
        try:
            self.engine.prefetch(job.tokens, job.segment_starts, job.tenant)
        except Exception:  # a store problem costs reuse, never the request
            log.exception("prefetching request %d's chunks failed", job.id)

    def _dequeued(self) -> None:
        with self._count_lock:
            self._submitted -= 1

    def abort(self, job: Job) -> None:
        job.gone.set()  # (read by a scoring of its prompt on the engine thread, between its passes)
        self._inbox.put(("abort", job))

    def call(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the engine thread, between steps; while sequences run, one call per step."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (future, fn, args)))
        return future

    async def score(self, job: Job):
        """The log-probs [len(prompt) - 1, vocab] of every prompt token of `job` but the first, as
        LLM.score gives them (None without logprobs or with a one-token prompt, or once the job is
        aborted: the scoring stops between its passes), on the engine thread."""
        return await asyncio.wrap_future(self.call(self._score, job))

    def _score(self, job: Job):
        tokens, n = job.tokens, job.params.logprobs
        if len(tokens) < 2 or n is None:
            return None
        try:
            lp, _ = self.engine.score(tokens[:1], tokens[1:], None, job.tenant, cancelled=job.gone.is_set)
        except ScoringCancelled:
            return None
        return lp

    async def publish(self, tokens: list[int]) -> Published:
        """Precompute a document's rows in a trusted context and share its chunks with every tenant
        (on the engine thread). Busy when the pool has no room now; a RequestError when it never will."""
        return await asyncio.wrap_future(self.call(self._publish, tokens))

    def _publish(self, tokens: list[int]) -> Published:
        try:
            done = self.engine.publish(tokens)
        except PoolBusy as e:
            raise Busy(str(e)) from None
        return Published(done.entries, done.tokens, done.skipped, done.rejected)

    async def refresh_stats(self, timeout: float = 5.0) -> EngineStats:
        """A fresh snapshot, taken on the engine thread between steps (the last one if the thread does
        not answer in time)."""
        try:
            self.stats = await asyncio.wait_for(asyncio.wrap_future(self.call(self._snapshot)), timeout)
        except TimeoutError:
            pass
        return self.stats

    # -- the engine thread ---------------------------------------------------------------

    def _snapshot(self) -> EngineStats:
        s = self.engine.stats()
        radix = self.engine.prefix_cache_stats  # (None when nothing is cached)
        prefix = None if radix is None else PrefixCacheStats(radix.bytes, radix.budget_bytes, radix.nodes)
        return EngineStats(
            s["kv_pool_bytes_used"],
            s["kv_pool_bytes_capacity"],
            s["cached_bytes"],
            s["running_sequences"],
            s["waiting_sequences"],
            tuple(tier_stats(self.registry)) if self.registry is not None else (),
            prefix,
        )

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not self.engine.has_work and not self._calls)
                if self._calls:
                    self._run(*self._calls.popleft())
                if self.engine.has_work:
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
            job.seq = self.engine.new_sequence(
                job.tokens, job.params, job.segment_starts, tenant=job.tenant, matcher=job.matcher, leader=lead
            )
        except Exception as e:  # NOTE: nothing a request sends may stop this thread
            self._dequeued()
            if isinstance(e, RequestError):
                job.emit(Failed(400, str(e)))
            else:
                log.exception("accepting request %d failed", job.id)
                job.emit(Failed(500, f"internal error while accepting the request: {e}"))
            return
        self._jobs[job.seq.id] = job
        self.engine.add_request(job.seq)

    def _admitted(self, seq: Sequence) -> None:
        if seq.id not in self._admitted_ids:  # the first admission, not a re-admission after preemption
            self._admitted_ids.add(seq.id)
            self._dequeued()
            if self.metrics:
                self.metrics.admitted(seq.stats)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing the %d running requests", self.engine.running_count)
            for seq in self.engine.abort_running():
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
            fresh = tuple(out.seq.logprobs[job.logprobs_sent :])
            job.logprobs_sent += len(fresh)
            if out.text or fresh:
                job.emit(Delta(out.text, fresh))
            if out.finished:
                self._admitted_ids.discard(out.seq.id)
                done = self._jobs.pop(out.seq.id).seq
                # (a job in _jobs was accepted: it has its sequence; a finished sequence has its reason)
                assert done is not None and done.finish_reason is not None
                finished = Finished(
                    done.text,
                    done.finish_reason,
                    done.stats,
                    len(done.output_ids),
                    tuple(done.logprobs) if done.params.logprobs is not None else None,
                )
                job.emit(finished)
                if self.metrics:
                    self.metrics.finished(
                        self._shown_reason(job, finished), len(done.output_ids), now=now, arrival=job.arrival
                    )

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
            assert job.seq is not None  # (a job in _jobs, the only ones that end here, was accepted)
            self.metrics.finished("abort", len(job.seq.output_ids), now=time.monotonic(), arrival=job.arrival)

    def _abort(self, job: Job) -> None:
        if job.seq is None or job.seq.id not in self._jobs:
            return  # never accepted, or already done
        if self.engine.is_waiting(job.seq):
            self._dequeued()
        self.engine.abort(job.seq)
        del self._jobs[job.seq.id]
        self._admitted_ids.discard(job.seq.id)
        if self.metrics:
            self.metrics.finished("abort", len(job.seq.output_ids), now=time.monotonic(), arrival=job.arrival)
