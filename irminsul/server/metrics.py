"""Prometheus metrics for /metrics: where prompt rows came from, latency, the store and the queue.

Token counters and latency histograms are updated by the engine thread as requests are admitted
and finish; pool, store, prefix-tree and queue gauges come from the snapshot the engine thread takes
for each scrape (EngineClient.refresh_stats): nothing here reads the engine's state itself.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from irminsul.engine.sequence import RequestStats

disable_created_metrics()  # no *_created series: they double the scrape for no use here

# Buckets as in vLLM's TTFT / inter-token histograms (seconds).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_KINDS = ("prompt", "prefix", "reused", "carve_out", "computed", "s1")


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model": model_name}
        self.tokens = {
            kind: Counter(
                f"irminsul_{kind}_tokens", f"{kind} tokens of admitted prompts", ["model"], registry=self.registry
            ).labels(**labels)
            for kind in TOKEN_KINDS
        }
        self.generation = Counter(
            "irminsul_generation_tokens", "generated tokens", ["model"], registry=self.registry
        ).labels(**labels)
        self.requests = Counter(
            "irminsul_requests", "finished requests", ["model", "finish_reason"], registry=self.registry
        )
        self.errors = Counter(
            "irminsul_request_errors", "requests refused or failed", ["model", "status"], registry=self.registry
        )
        self._ttft = Histogram(
            "irminsul_time_to_first_token_seconds",
            "time to first token",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self._itl = Histogram(
            "irminsul_inter_token_latency_seconds",
            "time between output tokens",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self._e2e = Histogram(
            "irminsul_e2e_request_latency_seconds",
            "arrival to finish",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.model_name = model_name

    # -- updates (scheduler thread) ------------------------------------------------------

    def admitted(self, stats: RequestStats) -> None:
        for kind in TOKEN_KINDS:
            self.tokens[kind].inc(getattr(stats, f"{kind}_tokens"))

    def ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def finished(self, reason: str, completion_tokens: int, now: float, arrival: float) -> None:
        self.requests.labels(self.model_name, reason).inc()
        self.generation.inc(completion_tokens)
        self._e2e.observe(now - arrival)

    def error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    # -- scrape-time gauges --------------------------------------------------------------

    def watch(self, client) -> None:
        """Scrape-time gauges from `client` (an EngineClient): its queue and its latest stats snapshot."""
        self.registry.register(_StateCollector(client, self.model_name))

    def watch_loop(self, stalls: LoopStalls) -> None:
        """The event loop's longest stall as a gauge (see LoopStalls)."""
        self.registry.register(_LoopCollector(stalls, self.model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoopStalls:
    """The event loop's longest stall: a task that wakes every `period` seconds and records how much
    later than asked it woke. Anything that runs on the loop for long (work proportional to a request's
    size, a blocking call) shows here, whichever request caused it."""

    def __init__(self, period: float = 0.01):
        self.period, self.longest = period, 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tick())

    def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.get_loop().is_closed():
            task.get_loop().call_soon_threadsafe(task.cancel)

    async def _tick(self) -> None:
        while True:
            asked = time.monotonic() + self.period
            await asyncio.sleep(self.period)
            self.longest = max(self.longest, time.monotonic() - asked)


class _LoopCollector:
    def __init__(self, stalls: LoopStalls, model_name: str):
        self.stalls, self.model = stalls, model_name

    def collect(self):
        g = GaugeMetricFamily(
            "irminsul_event_loop_stall_seconds_max",
            "the longest the event loop was kept from running its ticker since the start",
            labels=["model"],
        )
        g.add_metric([self.model], self.stalls.longest)
        yield g


class _StateCollector:
    def __init__(self, client, model_name: str):
        self.client, self.model = client, model_name

    def collect(self):
        m = [self.model]
        st = self.client.stats  # taken on the engine thread (the pool and the caches are its alone)
        for name, doc, value in (
            ("irminsul_running_requests", "requests being prefilled or decoded", st.running_sequences),
            ("irminsul_running_sequences", "sequences holding rows in the pool", st.running_sequences),
            ("irminsul_queued_requests", "requests waiting for admission", self.client.queued),
            (
                "irminsul_kv_pool_bytes_used",
                "pool bytes held by running requests or cached content",
                st.kv_pool_bytes_used,
            ),
            ("irminsul_kv_pool_bytes_capacity", "pool size (--kv-cache-gib)", st.kv_pool_bytes_capacity),
            ("irminsul_cached_bytes", "pool bytes the prefix tree and the chunk registry hold", st.cached_bytes),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model"])
            g.add_metric(m, value)
            yield g
        if not st.tiers:  # reuse=off: no store
            return
        gauges = {
            f: GaugeMetricFamily(f"irminsul_store_{f}", f"store {f} per tier", labels=["model", "tier"])
            for f in ("bytes", "entries", "budget_bytes", "pending_writes", "available")
        }
        counters = {
            f: CounterMetricFamily(f"irminsul_store_{f}", f"store {f} per tier", labels=["model", "tier"])
            for f in ("hits", "misses", "evictions", "insertions", "corrupt", "failures", "dropped")
        }
        for t in st.tiers:
            labels = [self.model, t.tier]
            values = {
                "bytes": t.bytes,
                "entries": t.entries,
                "budget_bytes": t.budget_bytes,
                "pending_writes": t.pending,
                "available": int(t.available),
            }
            for f, g in gauges.items():
                g.add_metric(labels, values[f])
            for f, c in counters.items():
                c.add_metric(labels, getattr(t, f))
        yield from gauges.values()
        yield from counters.values()
        r = st.prefix_cache
        for name, value in (
            () if r is None else (("bytes", r.bytes), ("budget_bytes", r.budget_bytes), ("nodes", r.nodes))
        ):
            g = GaugeMetricFamily(f"irminsul_prefix_cache_{name}", f"radix tree {name}", labels=["model"])
            g.add_metric(m, value)
            yield g
