"""The fleet simulator: a trace replayed over N model-free replicas, routed by each policy.

Each replica is what `irminsul bench recovery` replays (`workloads/recovery.py: replay_planner`):
the real planner over a `MemoryRegistry`, a `RadixCache` and S1 windows, payloads None, here with a
pool of `pool_tokens` per replica (the registry's budget in bytes = tokens x bytes per token, and
the tree's). A `ChunkJournal` follows each registry exactly as the KV manager's `ReuseCache` wires it,
and the content router follows the journals. Policies:

  content       `irminsul.fleet.router.ContentRouter`, journals read every `poll_s`, load fresh;
  prefix        Ray Serve's `PrefixCacheAffinityRouter`: if the in-flight counts differ by less
                than `imbalanced_threshold` (its example config: 10), the replica whose tree of
                routed prompts matches the longest prefix when the match is >= 10% of the prompt
                (`match_rate_threshold` 0.1), else the replica with the smallest tree; when
                imbalanced, power of two choices;
  sglang        SGLang's cache-aware router: the same tree, a match ratio > `cache_threshold` 0.3,
                else the smallest tree; when imbalanced ((max - min) > 64 and max > 1.5 x min
                in-flight requests, its balance_abs / balance_rel thresholds), the shortest queue;
  least_loaded  the fewest requests in flight, then the fewest queued prefill tokens;
  p2c           power of two choices on requests in flight (Ray Serve's default);
  perfect       one replica holding the whole fleet's pool (N x pool_tokens): the reuse ceiling.

The prefix trees are the routers' own, of the prompts they routed (as Ray's and SGLang's are), not
the replicas': they never forget a prompt a replica evicted.

Load model (simple on purpose): requests arrive in trace order at a fixed rate, set so that the
fleet would be `offered_load` busy if it computed only what one replica with an unbounded pool
computes (the fleet is sized for the work reuse leaves, so a policy that loses reuse, or piles
every request on one replica, builds queues); a replica computes its requests' tokens
first come first served at `tokens_per_s`, and a request stays in flight until its prefill is done
plus `decode_s`. A replica's load is its requests in flight and its prefill tokens not yet computed.
Reuse is decided when a request arrives, as if its rows were computed at once (the replica's cache
does not wait for the queue). A request's TTFT is its wait in that queue plus its own prefill; for
`perfect` the one replica computes at N x `tokens_per_s` (one queue with the fleet's whole rate: the
ideal of pooling, for reuse and waiting alike).
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from irminsul.fleet.router import ContentRouter, LoadBound, ReplicaLoad, ReplicaView, RouterWeights
from irminsul.kvcache.chunker import ChunkerConfig, namespace_seed
from irminsul.kvcache.journal import ChunkJournal
from irminsul.kvcache.planner import Planner, PlannerConfig
from irminsul.kvcache.radix import RadixCache
from irminsul.kvcache.registry import MemoryRegistry
from irminsul.kvcache.windows import WindowIndex
from irminsul.research.workloads.recovery import BYTES_PER_TOKEN
from irminsul.research.workloads.render import Rendered

POLICIES = ("content", "prefix", "sglang", "least_loaded", "p2c", "perfect")
UNBOUNDED = 2**62


@dataclass(frozen=True)
class FleetConfig:
    pool_tokens: int  # each replica's pool
    chunker: ChunkerConfig = field(default_factory=ChunkerConfig)
    sink: int = 32
    window: int = 128
    segments: bool = True  # replicas plan with the trace's segment starts (S2), as a server given them
    bytes_per_token: int = BYTES_PER_TOKEN
    model_id: str = "replay"
    weights: RouterWeights = field(default_factory=RouterWeights)
    bound: LoadBound | None = field(default_factory=LoadBound)  # the content router's (None: no bound)
    assignment_ttl_s: float = 30.0
    poll_s: float = 1.0  # the content router reads every replica's journal this often
    tokens_per_s: float = 20_000.0  # a replica's prefill rate
    offered_load: float = 0.5  # arrival rate: this share of the fleet's prefill rate at the best reuse
    decode_s: float = 0.5  # in flight after its prefill
    decode_tokens: int = 16  # a request's decoded tokens, for its work (bench_fleet's max_tokens)
    ray_match_threshold: float = 0.1  # Ray's match_rate_threshold
    ray_imbalanced_threshold: int = 10  # Ray's imbalanced_threshold, in requests
    sglang_cache_threshold: float = 0.3
    sglang_balance_abs: int = 64
    sglang_balance_rel: float = 1.5
    seed: int = 0  # power of two's draws

    def __post_init__(self):
        if self.pool_tokens < 1:
            raise ValueError(f"pool_tokens={self.pool_tokens} must be >= 1")
        if self.offered_load <= 0 or self.tokens_per_s <= 0:
            raise ValueError("offered_load and tokens_per_s must be > 0")


@dataclass(frozen=True)
class FleetResult:
    policy: str
    replicas: int
    requests: int
    prompt_tokens: int
    computed_tokens: int
    requests_per_replica: tuple[int, ...]  # (perfect: one replica)
    seconds: float
    ttft_p50_s: float = 0.0  # the load model's TTFT: queue wait + own prefill
    ttft_p95_s: float = 0.0
    # prompt tokens each replica computed plus the tokens it decoded (empty: the requests stand in)
    work_per_replica: tuple[int, ...] = ()

    @property
    def reuse(self) -> float:
        """Prompt tokens the fleet did not compute, as a share of all prompt tokens."""
        return 1 - self.computed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_share(self) -> float:
        """The busiest replica's share of the work: prompt tokens computed plus tokens decoded."""
        if not self.work_per_replica:
            return self.max_request_share
        total = sum(self.work_per_replica)
        return max(self.work_per_replica) / total if total else 0.0

    @property
    def max_request_share(self) -> float:
        """The busiest replica's share of the requests."""
        return max(self.requests_per_replica) / self.requests if self.requests else 0.0


class SimReplica:
    """One replica's cache, model-free, and its queue."""

    def __init__(self, name: str, pool_tokens: int, config: FleetConfig, tokens_per_s: float | None = None):
        budget = pool_tokens * config.bytes_per_token
        self.name, self.config = name, config
        self.tokens_per_s = tokens_per_s or config.tokens_per_s
        self.registry = MemoryRegistry(budget)
        self.radix = RadixCache(budget, config.bytes_per_token)
        self.planner = Planner(
            PlannerConfig(chunker=config.chunker, sink=config.sink, window=config.window),
            self.registry,
            self.radix,
            WindowIndex(config.window),
            seed=namespace_seed(config.model_id),
        )
        self.journal = ChunkJournal()  # wired as ReuseCache (kvcache/caches.py) wires its own
        self.registry.on_store.append(lambda entry: self.journal.added(entry.fingerprint))
        self.registry.on_evict.append(lambda entry: self.journal.removed(entry.fingerprint))
        self.busy_until = 0.0  # its prefill queue is empty from then on
        self._finishes: list[float] = []  # heap: when each request in flight is done
        self.requests = self.computed = 0
        self.ttfts: list[float] = []  # each request's wait in the queue plus its own prefill

    def serve(self, now: float, tokens: np.ndarray, segments) -> int:
        """Plan, register and insert the prompt as the engine does after a request; its computed
        tokens join the queue (its TTFT: when the queue has computed them). Returns them."""
        plan = self.planner.plan(tokens, segments)
        self.planner.register(
            plan,
            rows_of=lambda a, b: None,
            nbytes_of=lambda k: k * self.config.bytes_per_token,
            segment_starts=segments,
        )
        self.radix.insert(tokens, None)
        self.planner.release(plan)
        computed = plan.stats.computed_tokens
        self.busy_until = max(now, self.busy_until) + computed / self.tokens_per_s
        self.ttfts.append(self.busy_until - now)
        heapq.heappush(self._finishes, self.busy_until + self.config.decode_s)
        self.requests, self.computed = self.requests + 1, self.computed + computed
        return computed

    def in_flight(self, now: float) -> int:
        while self._finishes and self._finishes[0] <= now:
            heapq.heappop(self._finishes)
        return len(self._finishes)

    def load(self, now: float) -> ReplicaLoad:
        queued = int(max(0.0, self.busy_until - now) * self.tokens_per_s)
        return ReplicaLoad(running=self.in_flight(now), queued_prefill_tokens=queued)


class _PrefixRouter:
    """Ray's and SGLang's rule over trees of the prompts each replica was sent."""

    def __init__(self, names: list[str], config: FleetConfig, sglang: bool, rng: random.Random):
        self.names, self.config, self.sglang, self.rng = names, config, sglang, rng
        self.trees = {n: RadixCache(UNBOUNDED, 1) for n in names}

    def choose(self, tokens: np.ndarray, replicas: dict[str, SimReplica], now: float) -> str:
        c, flights = self.config, {n: replicas[n].in_flight(now) for n in self.names}
        hi, lo = max(flights.values()), min(flights.values())
        if self.sglang:
            if hi - lo > c.sglang_balance_abs and hi > c.sglang_balance_rel * lo:
                return min(self.names, key=lambda n: (flights[n], n))
        elif hi - lo >= c.ray_imbalanced_threshold:
            return _two_choices(self.names, flights, self.rng)
        matched = {n: self.trees[n].match(tokens).length for n in self.names}
        best = max(matched.values())
        rate = best / len(tokens)
        if (rate > c.sglang_cache_threshold) if self.sglang else (rate >= c.ray_match_threshold):
            return min((n for n in self.names if matched[n] == best), key=lambda n: (flights[n], n))
        return min(self.names, key=lambda n: (self.trees[n].stats.bytes, flights[n], n))  # the smallest tree

    def routed(self, name: str, tokens: np.ndarray) -> None:
        self.trees[name].insert(tokens, None)


def _two_choices(names: list[str], flights: dict[str, int], rng: random.Random) -> str:
    if len(names) == 1:
        return names[0]
    a, b = rng.sample(names, 2)
    return a if flights[a] <= flights[b] else b


@dataclass(frozen=True)
class Reference:
    """One replica with an unbounded pool over the trace."""

    distinct_tokens: int  # tokens of the content chunks it ends up holding: the trace's distinct content
    computed_tokens: int  # what it computes: the least any fleet can

    def interval_s(self, requests: int, replicas: int, config: FleetConfig) -> float:
        """Seconds between arrivals that keep `replicas` replicas `offered_load` busy at this work."""
        work_s = self.computed_tokens / max(requests, 1) / config.tokens_per_s
        return work_s / (config.offered_load * replicas)


def reference(trace: Sequence[tuple[str, Rendered]], config: FleetConfig) -> Reference:
    replica = SimReplica("all", UNBOUNDED // config.bytes_per_token, config)
    for i, (_, r) in enumerate(trace):
        replica.serve(float(i), r.token_ids.astype(np.int64), r.segment_starts if config.segments else None)
    return Reference(replica.registry.stats.bytes // config.bytes_per_token, replica.computed)


def own_sessions(trace: Sequence[tuple[str, Rendered]], config: FleetConfig) -> int:
    """Prompt tokens computed if every session had a replica of its own with an unbounded pool: what a
    session's own history saves, and nothing of what another session's content would. A fleet that
    keeps each session on one replica reuses this much at any N, plus what it finds of the sessions
    it put beside it; `perfect` adds all the content the sessions share."""
    replicas: dict[str, SimReplica] = {}
    computed = 0
    for i, (session, r) in enumerate(trace):
        if session not in replicas:
            replicas[session] = SimReplica(session, UNBOUNDED // config.bytes_per_token, config)
        segments = r.segment_starts if config.segments else None
        computed += replicas[session].serve(float(i), r.token_ids.astype(np.int64), segments)
    return computed


def simulate(
    trace: Sequence[tuple[str, Rendered]],
    policy: str,
    replicas: int,
    config: FleetConfig,
    interval_s: float,
    progress: bool = False,
) -> FleetResult:
    """Replay `trace` over `replicas` replicas routed by `policy`, a request every `interval_s`."""
    from tqdm import tqdm

    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: use {', '.join(POLICIES)}")
    start = time.perf_counter()
    perfect = policy == "perfect"
    names = ["r0"] if perfect else [f"r{i}" for i in range(replicas)]
    pool = config.pool_tokens * (replicas if perfect else 1)
    rate = config.tokens_per_s * (replicas if perfect else 1)
    fleet = {n: SimReplica(n, pool, config, rate) for n in names}
    prompt_tokens = sum(len(r.token_ids) for _, r in trace)
    rng = random.Random(config.seed)
    router = views = prefix = None
    now, next_poll = 0.0, 0.0
    if policy == "content":
        router = ContentRouter(
            config.model_id,
            config.chunker,
            config.weights,
            config.assignment_ttl_s,
            clock=lambda: now,
            sink=config.sink,
            bound=config.bound,
        )
        views = {n: ReplicaView(n) for n in names}
    elif policy in ("prefix", "sglang"):
        prefix = _PrefixRouter(names, config, policy == "sglang", rng)
    for i, (_, r) in enumerate(tqdm(trace, desc=f"{policy} x{replicas}", disable=not progress, leave=False)):
        now = i * interval_s
        tokens = r.token_ids.astype(np.int64)
        segments = r.segment_starts if config.segments else None
        if perfect:
            name = "r0"
        elif router is not None:
            if now >= next_poll:
                for n, view in views.items():
                    view.apply(fleet[n].journal.since(view.seq))
                next_poll = now + config.poll_s
            for n, view in views.items():
                view.load = fleet[n].load(now)
            decision = router.choose(tokens, views, segments)
            router.record(decision, tokens, segments)
            name = decision.replica
        elif prefix is not None:
            name = prefix.choose(tokens, fleet, now)
            prefix.routed(name, tokens)
        else:
            flights = {n: fleet[n].in_flight(now) for n in names}
            if policy == "p2c":
                name = _two_choices(names, flights, rng)
            else:
                name = min(names, key=lambda n: (flights[n], fleet[n].load(now).queued_prefill_tokens, n))
        fleet[name].serve(now, tokens, segments)
    ttfts = np.array([t for f in fleet.values() for t in f.ttfts]) if trace else np.zeros(1)
    return FleetResult(
        policy,
        replicas,
        len(trace),
        prompt_tokens,
        sum(f.computed for f in fleet.values()),
        tuple(f.requests for f in fleet.values()),
        time.perf_counter() - start,
        float(np.percentile(ttfts, 50)),
        float(np.percentile(ttfts, 95)),
        tuple(f.computed + f.requests * config.decode_tokens for f in fleet.values()),
    )


def run_fleet(
    trace: Sequence[tuple[str, Rendered]],
    replicas: Sequence[int],
    policies: Sequence[str],
    config: FleetConfig,
    ref: Reference,
    progress: bool = False,
) -> list[FleetResult]:
    """Every policy at every fleet size (`ref`: the trace's `reference`, for the arrival rate)."""
    from tqdm import tqdm

    unknown = set(policies) - set(POLICIES)
    if unknown:
        from irminsul.errors import UserFacingError

        raise UserFacingError(f"unknown policies {sorted(unknown)}: use {', '.join(POLICIES)}")
    grid = [(n, p) for n in replicas for p in policies]
    return [
        simulate(trace, p, n, config, ref.interval_s(len(trace), n, config), progress=progress)
        for n, p in tqdm(grid, desc="fleet", disable=not progress)
    ]
