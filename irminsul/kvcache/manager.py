"""The KV manager: the one owner of an engine's latent pool ([design](../../docs/design.md), sections 3 and 4).

It owns the pool's slots, their reference counts and the one eviction order over the rows only
caches hold (`eviction.py`), and turns the cache's plans into slot tables:

  off     every prompt token is computed (the quality reference); nothing is cached;
  prefix  exact-prefix rows from the radix tree, shared as they are;
  naive   prefix + content-addressed chunks, `k_r` read at the position it was computed at (stale
          `k_r`: the paper's baseline), no sink carve-out;
  pic     prefix + content-addressed chunks with the sink carve-out; every row read at its position
          in the new sequence, which is the δ-rotation done when attention reads the key.

The radix tree, the registry and the S1 windows (`irminsul/kvcache/`) are pure bookkeeping over token
ids and slot ids; this module is where slots are taken, shared and freed. A hit never copies: a
sequence that reuses a chunk takes one more reference on its slots. Chunks are offered to the
registry as soon as their rows are computed (in-flight reuse), and a request whose chunks a running
sequence is computing right now waits for them instead of computing them again.

The manager never writes into a sequence: admission returns an `Admission` and fresh rows come back
as slots, which the scheduler applies to its own sequence (`admission.py`). What the mode caches
is a `Cache` it holds (`caches.py`); the registry it runs over is a `ChunkStore`.

Making room for n rows evicts about n: the oldest of the rows that only caches hold, wherever they
are named (tree, registry or both); the structures then forget what named them.
"""

from __future__ import annotations

import numpy as np
import torch

from irminsul.errors import RequestError
from irminsul.kvcache.admission import Admission, AdmissionStats, CachedSequence
from irminsul.kvcache.caches import UNBOUNDED, Cache, ChunkNaming, NoCache, ReuseCache
from irminsul.kvcache.config import KVCacheConfig
from irminsul.kvcache.eviction import EvictionOrder
from irminsul.kvcache.journal import ChunkJournal
from irminsul.kvcache.namespaces import SHARED, Namespaces
from irminsul.kvcache.planner import Plan, Planner, PlannerConfig
from irminsul.kvcache.pool import LatentPool
from irminsul.kvcache.radix import RadixCache
from irminsul.kvcache.registry import ChunkStore, Entry, slots_of
from irminsul.model.attention import EMPTY_SLOT

__all__ = ["MIN_EVICTION", "UNBOUNDED", "KVCacheManager", "PoolBusy", "PoolFull"]

# an eviction takes at least this many rows (or a 32nd of the pool, if less): decoding on a full pool
# then walks the caches once every few steps, not on every step (`python benchmarks/bench_eviction.py`)
MIN_EVICTION = 256


class PoolFull(RequestError):
    """The request cannot get rows now, even after evicting every cached row nobody is using."""


class PoolBusy(PoolFull):
    """... but it could once running requests give theirs back: a retry may succeed (a 503)."""


class KVCacheManager:
    def __init__(
        self,
        config: KVCacheConfig | str,
        pool: LatentPool,
        num_layers: int,
        registry: ChunkStore | None = None,
        **options,
    ):
        """`config`: the cache's options, or its reuse mode with the other options as keywords
        (`KVCacheConfig`'s fields). `registry`: the content registry the cache runs over (the store
        tiers' `TieredRegistry`, say); an in-memory one by default."""
        if isinstance(config, str):
            config = KVCacheConfig(config, **options)
        elif options:
            raise TypeError("give the cache's options in its KVCacheConfig, not as keywords too")
        if config.recompute_ratio and not 0 < config.check_layer < num_layers:
            raise RequestError(f"check_layer={config.check_layer} must be in [1, {num_layers - 1}]")
        self.config, self.pool = config, pool
        self.order = EvictionOrder(pool.n_slots)
        self.inflight: dict[int, int] = {}  # fingerprint -> running sequences that will compute it
        self.evicted_rows = 0  # rows eviction has freed, in all
        self.cache: Cache = (
            ReuseCache(config, pool.bytes_per_slot, registry, self._hold, self._unhold, self._promote, self._to_lower)
            if config.caching
            else NoCache()
        )  # (off: cache options are accepted and ignored)

    @property
    def mode(self) -> str:
        return self.config.reuse

    @property
    def tenant_share(self) -> float | None:
        return self.config.tenant_share

    @property
    def recompute_ratio(self) -> float:
        return self.config.recompute_ratio if self.caching else 0.0

    @property
    def check_layer(self) -> int:
        return self.config.check_layer if self.caching else 1

    @property
    def caching(self) -> bool:
        return self.cache.caching

    @property
    def content_reuse(self) -> bool:
        return self.cache.content_reuse

    # what a reuse mode that caches holds (AttributeError with reuse=off: nothing is cached)

    @property
    def _reuse(self) -> ReuseCache:
        if not isinstance(self.cache, ReuseCache):
            raise AttributeError(f"reuse={self.mode} caches nothing: no registry, tree, namespaces or planners")
        return self.cache

    @property
    def registry(self) -> ChunkStore:
        return self._reuse.registry

    @property
    def radix(self) -> RadixCache:
        return self._reuse.radix

    @property
    def namespaces(self) -> Namespaces:
        return self._reuse.namespaces

    @property
    def planner_config(self) -> PlannerConfig:
        return self._reuse.planner_config

    def planner(self, tenant: str | None) -> Planner:
        return self._reuse.planner(tenant)

    @property
    def journal(self) -> ChunkJournal | None:
        """The chunks the pool holds, for a fleet router to follow (None: no cache)."""
        return self.cache.journal

    @property
    def max_rows(self) -> int:
        """The most rows one sequence can hold (slot 0 is reserved)."""
        return self.pool.n_slots - 1

    # -- holdings: the tree's and the registry's references on slots ------------------------

    def _hold(self, slots) -> None:
        slots = np.asarray(slots, np.int64)
        slots = slots[slots != EMPTY_SLOT]  # (a tenant's salt token names the empty slot)
        self.pool.retain(slots)
        self.order.hold(slots)

    def _unhold(self, slots) -> None:
        slots = np.asarray(slots, np.int64)
        slots = slots[slots != EMPTY_SLOT]
        self.order.unhold(slots)
        self.pool.release(slots)

    # -- admission ------------------------------------------------------------------------

    def waits_for(self, seq: CachedSequence) -> bool:
        """True if a running sequence is computing one of this prompt's chunks right now: admitting
        the prompt after those rows exist reuses them instead of computing them again."""
        if not self.inflight or not self.content_reuse:
            return False
        return any(
            c.fingerprint in self.inflight and c.fingerprint not in self.cache
            for c in self.cache.chunks(np.asarray(seq.tokens, np.int64), seq.segment_starts, seq.tenant)
        )

    def queued_tokens(self, waiting) -> int:
        """Prompt tokens these queued sequences will compute, in order: a chunk the registry holds,
        a running sequence is computing (in-flight reuse) or an earlier one in the queue computes is
        counted once, not once per request, so a burst of requests for one document reads as one
        document's work and its headers. Rows below the sink count for each (they are computed)."""
        if not self.content_reuse:
            return sum(seq.prompt_len for seq in waiting)
        sink, total = self.cache.sink, 0
        seen: set[int] = set()
        for seq in waiting:
            cut = self.cache.chunks(np.asarray(seq.tokens, np.int64), seq.segment_starts, seq.tenant)
            for c in cut:  # (a chunk repeated within one prompt is computed each time: both count)
                if c.fingerprint in seen or c.fingerprint in self.inflight or c.fingerprint in self.cache:
                    total += max(0, min(c.end, sink) - c.start)
                else:
                    total += c.end - c.start
            seen.update(c.fingerprint for c in cut)
        return total

    def admission(self, seq: CachedSequence) -> Admission:
        """Plan the prompt: a slot table pointing at the rows it reuses (one reference each, the
        sequence's from now on) and the positions left to compute. The chunks it computes are
        claimed as in flight until the sequence is freed."""
        n = len(seq.tokens)
        tokens = np.asarray(seq.tokens, dtype=np.int64)
        plan = self.cache.plan(tokens, seq.segment_starts, seq.tenant)
        if plan is None:
            return Admission(np.zeros(n, np.int64), np.arange(n, dtype=np.int64), None, AdmissionStats(n, 0, 0, n))
        slots = np.zeros(n, np.int64)
        pieces = plan.prefix.values if plan.prefix is not None else []
        prefix = np.concatenate([p.value[: p.length] for p in pieces]) if pieces else None
        for span in plan.spans:
            if span.kind == "prefix":
                assert prefix is not None, "a prefix span comes from a prefix match"
                slots[span.start : span.end] = prefix[span.start : span.end]
            elif span.kind == "reuse":
                assert span.entry is not None, "a reuse span names its entry"
                slots[span.start : span.end] = slots_of(span.entry)[span.src_offset : span.src_offset + len(span)]
        self.pool.retain(slots)
        reused = slots[slots != EMPTY_SLOT]
        if len(reused):
            self.order.touch(reused)
        # NOTE: the plan's pins and prefix lock kept its entries from eviction until now; the sequence
        # holds its own reference on every row it reuses from here, so they go now. Held until the
        # sequence finished, an entry whose rows it only partly uses (a carved-out sink) kept the
        # rest from eviction and could starve the sequence's own decoding of rows.
        self.cache.release(plan, seq.tenant)
        for c in plan.chunks:  # the chunks this sequence is about to compute
            if c.fingerprint not in self.cache:
                self.inflight[c.fingerprint] = self.inflight.get(c.fingerprint, 0) + 1
        st = plan.stats
        return Admission(
            slots,
            np.asarray(plan.compute_positions(), dtype=np.int64),
            plan,
            AdmissionStats(
                st.prompt_tokens,
                st.prefix_tokens,
                st.reused_tokens,
                st.computed_tokens,
                st.carve_out_tokens,
                st.s1_tokens,
            ),
        )

    def shared_admission(self, seq: CachedSequence, lead: CachedSequence) -> Admission:
        """Another choice of lead's prompt: one more reference on each of its prompt rows but the last,
        whose logits start this choice and which it computes. Counted as prefix tokens."""
        n = seq.prompt_len - 1
        slots = np.zeros(seq.prompt_len, np.int64)
        slots[:n] = lead.slots[:n]
        self.pool.retain(slots[:n])
        return Admission(slots, np.array([n], np.int64), None, AdmissionStats(seq.prompt_len, n, 0, 1))

    def release_rows(self, slots: np.ndarray) -> None:
        """A sequence gives back its references on these rows (pic+r: reused rows it recomputes)."""
        self.pool.release(slots)

    def fresh_rows(self, positions: np.ndarray, tenants: list[str | None]) -> np.ndarray | None:
        """Fresh slots (one reference each, the caller's) for rows computed at `positions`, evicting
        cached rows if needed; None (nothing taken) if the pool cannot give them. `tenants`: whose
        sequences they are for (`make_room`)."""
        slots = self.take(len(positions), tenants)
        if slots is not None:
            self.pool.mark_computed(slots, positions)
        return slots

    def take(self, n: int, for_tenants=None) -> np.ndarray | None:
        """n fresh slots (one reference each, the caller's), evicting if needed; None if not possible."""
        return self.pool.alloc(n) if self.make_room(n, for_tenants) else None

    # -- eviction ---------------------------------------------------------------------------

    def make_room(self, n: int, for_tenants=None) -> bool:
        """Evict until n slots are free: the oldest rows that only caches hold, whichever structure
        names them (about n of them: a registry entry goes whole, so its other rows may come free
        too). False, evicting nothing, if even every such row would not be enough.

        With a `tenant_share`, room made for the sequences of `for_tenants` (None: the default
        tenant) comes first from their owners' own cached rows and from owners holding more than
        their share of the pool; another owner's rows within its share go only when that is not
        enough."""
        if self.pool.free >= n:
            return True
        if not self.caching:
            return False
        protected = self._in_planning()
        if self.tenant_share is not None:
            spared = self._within_share(for_tenants)
            if spared is not None and self._evict(n, protected | spared):
                return True
        return self._evict(n, protected)

    def _evict(self, n: int, protected: np.ndarray) -> bool:
        need, free = n - self.pool.free, self.pool.free
        candidates = self.order.evictable(self.pool.refs, protected)
        if len(candidates) < need:
            return False
        victims = self.order.oldest(candidates, max(need, min(MIN_EVICTION, self.pool.n_slots // 32)))
        gone = np.zeros(self.pool.n_slots, bool)
        gone[victims] = True
        self.cache.forget(gone)
        self.evicted_rows += self.pool.free - free
        return self.pool.free >= n

    def _in_planning(self) -> np.ndarray:
        """A mask of the rows a plan in progress holds (pinned entries, locked prefixes): a lower
        tier's hit is promoted, and may need room, while its plan is being made."""
        mask = np.zeros(self.pool.n_slots, bool)
        self.cache.in_planning(mask)
        return mask

    def _within_share(self, for_tenants) -> np.ndarray | None:
        """A mask of the rows of every owner but the requesters whose cached rows fit in its share of
        the pool; None if there are none. NOTE: O(cached entries and tree nodes) per call; it runs
        only when a share is set and the pool is short."""
        requesters = {self.cache.owner(t) for t in (for_tenants or [None])}
        assert self.tenant_share is not None, "make_room asks only with a share set"
        budget = self.tenant_share * (self.pool.n_slots - 1)
        rows = [r for r in self.cache.held_rows(requesters).values() if len(r) <= budget]
        if not rows:
            return None
        mask = np.zeros(self.pool.n_slots, bool)
        mask[np.concatenate(rows)] = True
        return mask

    # -- the store tiers: the pool's offload ----------------------------------------------

    def _to_lower(self, entry: Entry) -> Entry:
        """A memory entry (slots) as the disk and Redis tiers store it: its rows, read from the pool."""
        return Entry(
            entry.fingerprint,
            entry.token_ids,
            entry.base_pos,
            self.pool.read_host(slots_of(entry)),
            entry.nbytes,
            entry.namespace,
        )

    def _promote(self, entry: Entry) -> Entry | None:
        """A lower tier's hit (rows) into the pool and the memory tier; None if there is no room."""
        rows = entry.payload
        assert isinstance(rows, torch.Tensor), "a lower tier's entry holds its rows"
        n = len(entry.token_ids)
        slots = self.take(n)
        if slots is None:
            return None
        self.pool.write(slots, rows, entry.base_pos + np.arange(n))
        promoted = Entry(entry.fingerprint, entry.token_ids, entry.base_pos, slots, entry.nbytes, entry.namespace)
        stored = self.registry.memory.put(promoted)  # the memory tier takes its own reference
        self.pool.release(slots)  # ours: if the memory tier refused, the slots are free again
        return promoted if stored else None

    def prefetch(self, tokens: list[int], segment_starts, tenant: str | None) -> int:
        """Read this prompt's chunks from the disk and Redis tiers ahead of its admission, into the
        tiered registry's staging area. Pure of engine state: safe on any thread."""
        return self.cache.prefetch(np.asarray(tokens, dtype=np.int64), segment_starts, tenant)

    # -- as rows appear, and when a sequence ends -----------------------------------------

    def computed(self, seq: CachedSequence) -> int:
        """Offer the chunks whose rows now all exist to the registry (in-flight reuse); the prompt
        positions offered so far (the sequence's new `registered`)."""
        done = int(seq.pending[0]) if seq.in_prefill else seq.prompt_len
        if done > seq.registered and seq.reuse_plan is not None and self.content_reuse:
            self.cache.register(seq.tenant, seq.reuse_plan, seq.slots, self.pool.bytes_per_slot, upto=done)
            return done
        return seq.registered

    def free(self, seq: CachedSequence, cache: bool = True) -> None:
        """The sequence's references on its rows go (its owner then forgets its slot table). With
        `cache` (and a sequence that did not abort), its chunks and tokens are offered to the cache
        first (`offer`). Its plan's in-flight claims end either way."""
        try:
            if cache and seq.finish_reason != "abort":
                self.offer(seq)
        finally:
            self._end_claims(seq.reuse_plan)
            self.pool.release(seq.slots)

    def offer(self, seq: CachedSequence) -> None:
        """Register every chunk of the sequence's computed rows (prompt and output) and insert its
        tokens into the tree; both take their own references, the sequence keeps its own. (A
        sequence in another engine over the same pool may be offered too: the evaluations share
        one computed prompt between strategies.)"""
        if not self.caching or not (n := seq.filled):
            return
        tokens = np.asarray(seq.tokens[:n], dtype=np.int64)
        slots = seq.slots[:n]
        self.cache.register(seq.tenant, tokens, slots, self.pool.bytes_per_slot, segment_starts=seq.segment_starts)
        self.cache.insert(seq.tenant, tokens, slots)
        self.order.touch(slots[slots != EMPTY_SLOT])

    def _end_claims(self, plan: Plan | None) -> None:
        if plan is None:
            return
        for c in plan.chunks:
            if c.fingerprint in self.inflight:
                self.inflight[c.fingerprint] -= 1
                if self.inflight[c.fingerprint] <= 0:
                    del self.inflight[c.fingerprint]

    def publish(self, tokens: np.ndarray, segment_starts, compute):
        """A document's chunks into the shared namespace, computed in the trusted publishing context:
        `compute(slots)` computes the document alone, from position 0, into fresh `slots`. PoolBusy
        when the pool has no room for its rows while running requests hold theirs."""
        if not self.content_reuse:
            raise RequestError(f"publishing needs content reuse (pic or naive); this engine runs {self.mode}")
        n = len(tokens)
        slots = self.fresh_rows(np.arange(n), [None])
        if slots is None:
            raise PoolBusy(
                f"the KV pool ({self.pool.describe()}) has no room for this document's {n} rows "
                f"while the running requests hold theirs; retry later"
            )
        try:
            compute(slots)
            return self.cache.register(SHARED, tokens, slots, self.pool.bytes_per_slot, segment_starts=segment_starts)
        finally:
            self.pool.release(slots)

    def clear(self) -> None:
        """Evict every unpinned entry and unlocked prefix (their references go back to the pool)."""
        self.cache.clear()

    @property
    def prefix_stats(self):
        """The radix tree's stats (None: nothing is cached)."""
        return self.cache.prefix_stats

    @property
    def naming(self) -> ChunkNaming | None:
        """How this cache fingerprints chunks, for a fleet router (None: nothing is cached)."""
        return self.cache.naming

    @property
    def cached_slots(self) -> np.ndarray:
        """Distinct slots the tree and the registry hold (for the pool's statistics)."""
        return np.flatnonzero(self.order.held > 0)
