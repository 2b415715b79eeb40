"""The content-aware router: send each request to the replica where its chunks already are.

The router chunks a prompt exactly as a replica's KV manager does (the same content-defined
chunker, the same namespace seed, so the same xxHash64 fingerprints) and scores every replica by
the prompt tokens it would not have to compute there:

- chunks resident in its pool: what its chunk journal (`irminsul/kvcache/journal.py`) says its
  registry holds, plus the chunks this router sent it in the last `assignment_ttl_s` (`record`),
  so a burst of requests for a new document converges on one replica instead of computing the
  document once per replica before any poll shows it;
- a smaller credit (`store_credit`) for chunks only in the store every replica shares (Redis): a
  miss there is loaded, not computed, but loading is not free;
- as the planner counts them (`irminsul/kvcache/planner.py`): rows at target positions below the
  sink are computed (the carve-out), and the last prompt token is always computed.

Its cost, lowest wins:

    cost = compute * tokens_to_compute + queued * max(queued_tokens - slack, shortest_queue)
           + running * running_sequences

with tokens_to_compute = prompt - resident - store_credit * in_store, slack = min(resident,
queue_slack_tokens) and shortest_queue the fewest queued tokens of any replica. It is the shape of NVIDIA
Dynamo's KV router cost (`overlap_score_weight * prefill blocks to compute + decode blocks`), with
the overlap taken over content chunks at any offset instead of over a prefix. Every router a fleet
can pick today scores the prefix only: Dynamo's radix indexer and llm-d's precise prefix scorer
match chained block hashes from the first block, Ray Serve's `PrefixCacheAffinityRouter` and
SGLang's router match the longest prefix of the prompt text against a tree of routed prompts (above
a share of the prompt: Ray 0.1, SGLang 0.3, else least loaded). A document behind a new header
matches none of them past the header; here it matches the replica holding it.

The rule that follows: a request goes where it computes least, so a session's turn goes to the
replica holding its history, unless that replica is over the load bound (below), or its queue is
longer than the shortest by more than the slack: the tokens of this prompt it would reuse there, at
most `queue_slack_tokens`. Within the slack its queue does not count; beyond it each queued token
counts as a token of wait, as in Dynamo's cost. Counting every queued token (slack 0) picks the
shortest wait for this one request, and moves a session's turn to an idle replica as soon as its
home's queue is longer than its history: the turn computes the history again there. With the
slack, a request waits for its reuse at most as long as the reuse saves, and never more than the
cap; a replica that would reuse nothing has no slack, so unrelated traffic still goes to the
shortest queue.

What the router cannot see, so does not count: the replica's exact-prefix tree (its prefix rows
are in the registry as chunks too, and are counted as chunks, less the sink), S1 window recovery
inside chunks that missed, and a source-side carve-out (a chunk first stored at position 0 reused
further in) — each the same on every replica that holds the chunk, so the choice barely moves.

Queued prefill tokens are the replica's own count, each chunk its queue shares once
(`KVCacheManager.queued_tokens`), less the tokens of this prompt's chunks the router sent there and
its journal does not show yet: the queue computing them is the wait this prompt shares, and they
are counted as reuse already.

Requests the router sent a replica since that replica's last load report count as running
sequences on it: an unrelated burst spreads by count between reports, and a burst for one new
document stays together while its reuse outweighs them.

Bounded load (`LoadBound`, consistent hashing with bounded loads applied to work): the router keeps
the work it sent each replica in the last `assignment_ttl_s` (the prompt tokens it expected the
replica to compute there plus a decode estimate). A replica that this request would take above
(1 + epsilon) x the mean of that work over the replicas, plus `slack_tokens`, is not chosen while
another is within the bound: its cost is lifted above every replica's within it, so a caller that
ranks by cost (the Ray router) ranks it last too. The cost's load terms are instantaneous and a
document's reuse outweighs them, so without the bound a hot session (one document many requests
share) keeps its home replica busiest however much of the traffic it is; with it, once its home is
over the bound the session's next request goes to the next best replica, which computes the
document once and shares the session from then on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Container, Mapping
from dataclasses import dataclass, field

import numpy as np

from irminsul.fleet.fingerprints import FingerprintSet
from irminsul.kvcache.chunker import ChunkerConfig, as_tokens, chunk, fingerprint, namespace_seed
from irminsul.kvcache.journal import JournalDelta
from irminsul.kvcache.namespaces import SHARED
from irminsul.kvcache.planner import PlannerConfig


@dataclass(frozen=True)
class RouterWeights:
    # a prompt token the replica would compute: the unit every other weight is measured in
    compute: float = 1.0
    # a chunk only in the shared store is loaded, not computed: a Redis read of its rows (~31 KB a
    # token for DeepSeek-V2-Lite) plus the copy into the pool costs, at a few GB/s, the same order
    # as computing it on a busy GPU; half is a middle guess that still prefers a replica holding it
    store_credit: float = 0.5
    # a running sequence shares every step of a new prompt's prefill: it adds about one token of
    # compute per step, so over a prefill of a few thousand tokens at a 128-512-token step budget,
    # some 8-32 prompt tokens. 32, the high end: many decoding sequences lose ties, yet one reused
    # chunk of min_len (32) tokens outweighs one more running sequence
    running: float = 32.0
    # a queued prefill token is computed before this prompt's: a whole token of wait, counted from the
    # fleet's shortest queue plus the replica's slack (below)
    queued: float = 1.0
    # a replica's queue counts only beyond the shortest queue plus the prompt tokens it would reuse
    # there, at most this many: a session stays on the replica holding its history while the extra
    # wait is within what that history saves and within this cap (the most any request is asked to
    # wait for its reuse). 0: every queued token counts, as the shortest-wait cost does
    queue_slack_tokens: int = 1024

    def __post_init__(self):
        for name in ("compute", "store_credit", "running", "queued", "queue_slack_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"RouterWeights.{name}={getattr(self, name)} must be >= 0")
        if self.store_credit > 1:
            raise ValueError(
                f"RouterWeights.store_credit={self.store_credit} is a share of a chunk's tokens: at most 1"
            )


@dataclass(frozen=True)
class LoadBound:
    # a replica is not chosen while this request would take the work sent it in the window above
    # (1 + epsilon) x the mean over the replicas, plus slack_tokens, and another is within the bound
    epsilon: float = 0.2
    # so that a new document is not copied to every replica while the window holds little work
    slack_tokens: int = 8192
    # a request's work beyond the prompt tokens computed: its decoded tokens, estimated
    decode_tokens: int = 16

    def __post_init__(self):
        if self.epsilon < 0 or self.slack_tokens < 0 or self.decode_tokens < 0:
            raise ValueError(f"{self} must have epsilon, slack_tokens and decode_tokens >= 0")


@dataclass(frozen=True)
class ReplicaLoad:
    running: int = 0  # sequences decoding (or prefilling) now
    waiting: int = 0  # requests queued for admission
    queued_prefill_tokens: int = 0  # prompt tokens the queue will compute before a new request


class ReplicaView:
    """What the router knows of one replica: the chunks its journal says it holds, and its load."""

    def __init__(self, replica_id: str):
        self.replica_id = replica_id
        self.seq: int | None = None  # the journal number to ask `since` next (None: never polled)
        self.chunks = FingerprintSet()
        self._load = ReplicaLoad()
        self.load_reports = 0  # load reports so far: the router counts what it sent since the last

    def apply(self, delta: JournalDelta) -> None:
        """Follow the replica's chunk journal: `delta` is its `since(self.seq)`."""
        if delta.full:
            self.chunks.replace(delta.added)
        else:
            self.chunks.remove(delta.removed)
            self.chunks.add(delta.added)
        self.seq = delta.seq

    @property
    def load(self) -> ReplicaLoad:
        return self._load

    @load.setter
    def load(self, load: ReplicaLoad) -> None:
        self._load = load
        self.load_reports += 1

    def __len__(self) -> int:
        return len(self.chunks)


@dataclass(frozen=True)
class Decision:
    replica: str
    costs: dict[str, float]  # per replica id
    cached_tokens: dict[str, int]  # prompt tokens each replica would not compute (pool and store)
    explanation: str  # one line, for a debug response header
    # per replica id: the work it would take on (prompt tokens to compute + decode estimate)
    work: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptChunks:
    """A prompt as the replicas' registries key it."""

    n_tokens: int
    fingerprints: np.ndarray  # [k] uint64, the tenant's namespace
    shared: np.ndarray  # [k] uint64, the same chunks in the operator's shared namespace
    useful: np.ndarray  # [k] int64: a chunk's tokens a hit saves (outside the sink, not the last token)


class NoReplicas(RuntimeError):
    """There is no replica to route to (all died or none started yet)."""


@dataclass(frozen=True)
class _Sent:
    replica: str
    expires: float
    fingerprints: np.ndarray = field(repr=False)
    work: int = 0


_DEFAULT_CHUNKER = ChunkerConfig()  # (frozen: one instance serves every router as a default)


class ContentRouter:
    def __init__(
        self,
        model_id: str,
        chunker: ChunkerConfig = _DEFAULT_CHUNKER,
        weights: RouterWeights = RouterWeights(),
        assignment_ttl_s: float = 30.0,
        clock=time.monotonic,
        sink: int = PlannerConfig().sink,
        bound: LoadBound | None = LoadBound(),
    ):
        """`model_id`, `chunker` and `sink`: the replicas' own (`KVCacheManager(model_id=...)` and its
        planner's), or the fingerprints and the counts differ from theirs. `bound`: None, no bound
        on a replica's share of the work."""
        if assignment_ttl_s < 0:
            raise ValueError(f"assignment_ttl_s={assignment_ttl_s} must be >= 0")
        self.model_id, self.chunker, self.weights, self.sink = model_id, chunker, weights, sink
        self.assignment_ttl_s, self.clock, self.bound = assignment_ttl_s, clock, bound
        self._work: dict[str, int] = {}  # per replica: the work sent it that has not expired
        self._seeds: dict[str, tuple[int, int]] = {}  # tenant -> (its seed, the shared namespace's)
        # the chunks sent to each replica and not yet expired: fingerprint -> expiry
        self._assigned: dict[str, dict[int, float]] = {}
        self._sent: deque[_Sent] = deque()  # in the order sent, so expired ones leave from the left
        # per replica: (its load_reports when the router last sent it a request, expiry of each
        # request sent since that report): the requests its reported load does not show yet
        self._unreported: dict[str, tuple[int, deque[float]]] = {}
        self._reports_seen: dict[str, int] = {}  # per replica: its load_reports at the last choose
        self._last: tuple[Decision, PromptChunks] | None = None  # choose's chunks, for record

    # -- chunks -------------------------------------------------------------------------

    def chunks(self, token_ids, segment_starts=None, tenant: str = "") -> PromptChunks:
        """The prompt cut and fingerprinted as a replica's planner does for `tenant`."""
        if tenant not in self._seeds:
            self._seeds[tenant] = namespace_seed(self.model_id, tenant), namespace_seed(self.model_id, SHARED)
        seed, shared_seed = self._seeds[tenant]
        ids = as_tokens(token_ids)
        n = len(ids)
        cut = chunk(ids, self.chunker, seed, segment_starts)
        starts, ends = np.array([c.start for c in cut], np.int64), np.array([c.end for c in cut], np.int64)
        fps = np.array([c.fingerprint for c in cut], np.uint64)
        shared = np.array([fingerprint(ids[c.start : c.end], shared_seed) for c in cut], np.uint64)
        useful = np.maximum(0, np.minimum(ends, n - 1) - np.maximum(starts, self.sink))
        return PromptChunks(n, fps, shared, useful.astype(np.int64))

    # -- choosing -----------------------------------------------------------------------

    def choose(
        self,
        token_ids,
        replicas: Mapping[str, ReplicaView],
        segment_starts=None,
        tenant: str = "",
        store: Container[int] | None = None,
    ) -> Decision:
        if not replicas:
            raise NoReplicas("no replica to route to: none has started, or every one has left the fleet")
        self._expire()
        prompt = self.chunks(token_ids, segment_starts, tenant)
        in_store = (
            np.zeros(len(prompt.useful), bool)
            if store is None
            else np.array(
                [int(a) in store or int(b) in store for a, b in zip(prompt.fingerprints, prompt.shared)], bool
            )
        )
        w = self.weights
        costs, cached, work, queues, slack, parts = {}, {}, {}, {}, {}, {}
        k, listed = len(prompt.useful), prompt.fingerprints.tolist()
        both = np.concatenate([prompt.fingerprints, prompt.shared])
        for rid, view in replicas.items():
            found = view.chunks.contains(both)
            held = found[:k] | found[k:]
            assigned = self._assigned.get(rid)
            on_the_way = 0  # tokens of chunks sent there that its journal does not show yet
            if assigned and not assigned.keys().isdisjoint(listed):
                sent_there = np.fromiter((f in assigned for f in listed), bool, k)
                on_the_way = int(prompt.useful[sent_there & ~held].sum())
                held |= sent_there
            resident = int(prompt.useful[held].sum())
            # the replica's queue computing this prompt's own chunks is no wait beyond what computing
            # them here would take, and they are counted as reuse already: not a second time
            queued = max(0, view.load.queued_prefill_tokens - on_the_way)
            stored = int(prompt.useful[in_store & ~held].sum())
            self._reports_seen[rid] = view.load_reports
            sent = self._sent_since_report(rid, view.load_reports)
            running = view.load.running + sent
            to_compute = prompt.n_tokens - resident - w.store_credit * stored
            costs[rid] = w.compute * to_compute + w.running * running
            queues[rid], slack[rid] = queued, min(resident, w.queue_slack_tokens)
            cached[rid] = resident + stored
            work[rid] = prompt.n_tokens - resident - stored + (self.bound.decode_tokens if self.bound else 0)
            parts[rid] = (
                f" (reuse {resident}/{prompt.n_tokens}"
                + (f", store {stored}" if stored else "")
                + (f", queued {queued}" if queued else "")
                + f", running {running})"
            )
        # the queue: what this request waits beyond the shortest queue, less the slack its reuse buys
        shortest = min(queues.values())
        notes = {}
        for rid in replicas:
            costs[rid] += w.queued * max(queues[rid] - slack[rid], shortest)
            notes[rid] = f"{rid}: cost {costs[rid]:.0f}{parts[rid]}"
        over = self._over_bound(replicas, work)
        if over:
            lift = max(costs[r] for r in replicas if r not in over) - min(costs[r] for r in over) + 1
            for rid in over:
                costs[rid] += max(0.0, lift)
                notes[rid] = notes[rid][:-1] + ", over the load bound)"
        # ties: the less loaded, then the replica id, so the same state always gives the same choice
        order = sorted(replicas, key=lambda r: (costs[r], replicas[r].load.running + replicas[r].load.waiting, r))
        shown = " < ".join(notes[r] for r in order[:3]) + (f" < {len(order) - 3} more" if len(order) > 3 else "")
        decision = Decision(order[0], costs, cached, shown, work)
        self._last = decision, prompt
        return decision

    def record(self, decision: Decision, token_ids, segment_starts=None, tenant: str = "") -> None:
        """The router just sent this prompt to `decision.replica`: count its chunks as resident there
        for `assignment_ttl_s`, and the request as running there until the replica's next load
        report (or for `assignment_ttl_s`, if none comes)."""
        if self._last is not None and self._last[0] is decision and self._last[1].n_tokens == len(token_ids):
            prompt = self._last[1]
        else:
            prompt = self.chunks(token_ids, segment_starts, tenant)
        expires = self.clock() + self.assignment_ttl_s
        assigned = self._assigned.setdefault(decision.replica, {})
        for f in prompt.fingerprints.tolist():
            assigned[f] = expires
        work = decision.work.get(decision.replica, 0)
        self._sent.append(_Sent(decision.replica, expires, prompt.fingerprints, work))
        self._work[decision.replica] = self._work.get(decision.replica, 0) + work
        reports = self._reports_seen.get(decision.replica, 0)
        pending = self._unreported.get(decision.replica)
        if pending is None or pending[0] != reports:
            pending = self._unreported[decision.replica] = reports, deque()
        pending[1].append(expires)

    def forget(self, replica_id: str) -> None:
        """A replica died or left: drop what the router sent it (its view is the caller's to drop)."""
        self._assigned.pop(replica_id, None)
        self._sent = deque(s for s in self._sent if s.replica != replica_id)
        self._unreported.pop(replica_id, None)
        self._reports_seen.pop(replica_id, None)
        self._work.pop(replica_id, None)
        if self._last is not None and self._last[0].replica == replica_id:
            self._last = None

    def assigned(self, replica_id: str) -> int:
        """Chunks the router sent the replica that have not expired yet."""
        self._expire()
        return len(self._assigned.get(replica_id, ()))

    def sent_work(self, replica_id: str) -> int:
        """The work the router sent the replica that has not expired yet."""
        self._expire()
        return self._work.get(replica_id, 0)

    def _over_bound(self, replicas: Mapping[str, ReplicaView], work: dict[str, int]) -> set[str]:
        """The replicas this request would take above the load bound, if another stays within it."""
        if self.bound is None or len(replicas) < 2:
            return set()
        total = sum(self._work.get(r, 0) for r in replicas)
        over = set()
        for rid in replicas:
            mean = (total + work[rid]) / len(replicas)
            if self._work.get(rid, 0) + work[rid] > (1 + self.bound.epsilon) * mean + self.bound.slack_tokens:
                over.add(rid)
        return over if len(over) < len(replicas) else set()

    def _sent_since_report(self, replica_id: str, reports: int) -> int:
        """Requests sent to the replica since its load report number `reports` (and not expired)."""
        pending = self._unreported.get(replica_id)
        if pending is None or pending[0] != reports:
            return 0
        now, expiries = self.clock(), pending[1]
        while expiries and expiries[0] <= now:
            expiries.popleft()
        return len(expiries)

    def _expire(self) -> None:
        now = self.clock()
        while self._sent and self._sent[0].expires <= now:
            sent = self._sent.popleft()
            if sent.replica in self._work:
                self._work[sent.replica] -= sent.work
            assigned = self._assigned.get(sent.replica, {})
            for f in sent.fingerprints.tolist():
                if assigned.get(f, now + 1) <= now:  # (a later send of the same chunk keeps it)
                    del assigned[f]
