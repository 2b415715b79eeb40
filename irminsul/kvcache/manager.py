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

Making room for n rows evicts about n: the oldest of the rows that only caches hold, wherever they
are named (tree, registry or both); the structures then forget what named them.
"""

from __future__ import annotations

import inspect

import numpy as np

from irminsul.kvcache.chunker import ChunkerConfig, chunk
from irminsul.kvcache.planner import Plan, Planner, PlannerConfig
from irminsul.kvcache.radix import RadixCache
from irminsul.kvcache.registry import Entry, MemoryRegistry, Registry
from irminsul.engine.sequence import Sequence
from irminsul.errors import RequestError
from irminsul.kvcache.eviction import EvictionOrder
from irminsul.kvcache.journal import ChunkJournal
from irminsul.kvcache.modes import MODES
from irminsul.kvcache.namespaces import SHARED, Namespaces, owner_of
from irminsul.kvcache.pool import LatentPool
from irminsul.model.attention import EMPTY_SLOT

UNBOUNDED = 2**62  # the tree's and the registry's own byte budgets: the pool is the one budget
# an eviction takes at least this many rows (or a 32nd of the pool, if less): decoding on a full pool
# then walks the caches once every few steps, not on every step (`python benchmarks/bench_eviction.py`)
MIN_EVICTION = 256


class PoolFull(RequestError):
    """The request cannot get rows now, even after evicting every cached row nobody is using."""


class PoolBusy(PoolFull):
    """... but it could once running requests give theirs back: a retry may succeed (a 503)."""


class KVCacheManager:
    def __init__(self, mode: str, pool: LatentPool, num_layers: int, tenant: str = "", model_id: str = "",
                 carve_out: bool | None = None, s1: bool = True, registry: Registry | None = None,
                 recompute_ratio: float = 0.0, check_layer: int = 1, max_namespaces: int = 1024,
                 marker: tuple[int, ...] | None = None, tenant_share: float | None = None):
        """`tenant`: the namespace of requests that name none. `registry`: the content registry (the
        store tiers' `TieredRegistry`, say); an in-memory one by default. pic+r: `recompute_ratio` of
        the reused rows, chosen at `check_layer`. `tenant_share`: see `make_room`."""
        if mode not in MODES:
            raise RequestError(f"reuse={mode!r} is not a reuse mode; choose one of {', '.join(MODES)}")
        if tenant_share is not None and not (isinstance(tenant_share, (int, float)) and 0 < tenant_share <= 1):
            raise RequestError(f"tenant_share={tenant_share!r} must be a share of the pool in (0, 1]")
        if max_namespaces < 2:
            raise RequestError(f"max_namespaces={max_namespaces} must be at least 2 (one is the shared namespace)")
        if not 0.0 <= recompute_ratio <= 1.0:
            raise RequestError(f"recompute_ratio={recompute_ratio} must be in [0, 1]")
        if recompute_ratio and not 0 < check_layer < num_layers:
            raise RequestError(f"check_layer={check_layer} must be in [1, {num_layers - 1}]")
        self.mode, self.pool, self.tenant_share = mode, pool, tenant_share
        self.recompute_ratio, self.check_layer = (recompute_ratio, check_layer) if mode != "off" else (0.0, 1)
        self.order = EvictionOrder(pool.n_slots)
        self.inflight: dict[int, int] = {}  # fingerprint -> running sequences that will compute it
        self.evicted_rows = 0  # rows eviction has freed, in all
        self.registry: Registry | None = None
        self.journal: ChunkJournal | None = None
        self.radix: RadixCache | None = None
        self.namespaces: Namespaces | None = None
        if mode == "off":  # cache options are accepted and ignored: nothing is cached
            return
        # NOTE: "is None", not "or": an empty registry has len 0 and is falsy.
        self.registry = registry if registry is not None else MemoryRegistry(UNBOUNDED)
        self.registry.on_store.append(lambda entry: self._hold(entry.payload))
        self.registry.on_evict.append(lambda entry: self._unhold(entry.payload))
        self.journal = ChunkJournal()  # the chunks the pool holds, for a fleet router to follow
        self.registry.on_store.append(lambda entry: self.journal.added(entry.fingerprint))
        self.registry.on_evict.append(lambda entry: self.journal.removed(entry.fingerprint))
        if hasattr(self.registry, "bind"):  # store tiers below memory hold rows, memory holds slots
            self.registry.bind(self._promote, self._to_lower)
        self.radix = RadixCache(UNBOUNDED, pool.bytes_per_slot, on_store=self._hold, on_evict=self._unhold)
        if carve_out is None:
            carve_out = mode == "pic"  # the paper's naive baseline has no carve-out
        # marker: the paper's S2 variant, a model-visible boundary sequence that restarts chunking.
        chunker = ChunkerConfig(marker=tuple(marker) if marker else None)
        self.planner_config = PlannerConfig(chunker=chunker, content_reuse=mode != "prefix", s1=s1,
                                            carve_out=carve_out)
        self.namespaces = Namespaces(self.planner_config, self.registry, self.radix, model_id, tenant,
                                     max_namespaces)

    @classmethod
    def options(cls) -> set[str]:
        """The cache options an engine passes through (`Engine(..., **options)`)."""
        return set(inspect.signature(cls.__init__).parameters) - {"self", "mode", "pool", "num_layers"}

    @property
    def caching(self) -> bool:
        return self.mode != "off"

    @property
    def content_reuse(self) -> bool:
        return self.caching and self.planner_config.content_reuse

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

    @property
    def _memory(self):
        return getattr(self.registry, "memory", self.registry)  # (the tiers below hold rows, not slots)

    # -- admission ------------------------------------------------------------------------

    def planner(self, tenant: str | None) -> Planner:
        return self.namespaces.planner(tenant)

    def waits_for(self, seq: Sequence) -> bool:
        """True if a running sequence is computing one of this prompt's chunks right now: admitting
        the prompt after those rows exist reuses them instead of computing them again."""
        if not self.inflight or not self.content_reuse:
            return False
        return any(c.fingerprint in self.inflight and c.fingerprint not in self.registry
                   for c in self.planner(seq.tenant).chunk(np.asarray(seq.tokens, np.int64), seq.segment_starts))

    def queued_tokens(self, waiting) -> int:
        """Prompt tokens these queued sequences will compute, in order: a chunk the registry holds,
        a running sequence is computing (in-flight reuse) or an earlier one in the queue computes is
        counted once, not once per request, so a burst of requests for one document reads as one
        document's work and its headers. Rows below the sink count for each (they are computed)."""
        if not self.content_reuse:
            return sum(seq.prompt_len for seq in waiting)
        sink, seen, total = self.planner_config.sink, set(), 0
        for seq in waiting:
            cut = self.planner(seq.tenant).chunk(np.asarray(seq.tokens, np.int64), seq.segment_starts)
            for c in cut:  # (a chunk repeated within one prompt is computed each time: both count)
                if c.fingerprint in seen or c.fingerprint in self.inflight or c.fingerprint in self.registry:
                    total += max(0, min(c.end, sink) - c.start)
                else:
                    total += c.end - c.start
            seen.update(c.fingerprint for c in cut)
        return total

    def plan(self, seq: Sequence) -> None:
        """Plan the prompt and point the slot table at the rows it reuses (one reference each); the
        positions left to compute become the sequence's pending work."""
        n = len(seq.tokens)
        if not self.caching:
            seq.admit(np.zeros(n, np.int64), np.arange(n, dtype=np.int64), None,
                      dict(prompt_tokens=n, prefix_tokens=0, reused_tokens=0, computed_tokens=n))
            return
        planner = self.planner(seq.tenant)
        plan = planner.plan(np.asarray(seq.tokens, dtype=np.int64), seq.segment_starts)
        slots = np.zeros(n, np.int64)
        prefix = np.concatenate([p.value[: p.length] for p in plan.prefix.values]) if plan.prefix.values else None
        for span in plan.spans:
            if span.kind == "prefix":
                slots[span.start : span.end] = prefix[span.start : span.end]
            elif span.kind == "reuse":
                slots[span.start : span.end] = span.entry.payload[span.src_offset : span.src_offset + len(span)]
        self.pool.retain(slots)
        reused = slots[slots != EMPTY_SLOT]
        if len(reused):
            self.order.touch(reused)
        # NOTE: the plan's pins and prefix lock kept its entries from eviction until now; the sequence
        # holds its own reference on every row it reuses from here, so they go now. Held until the
        # sequence finished, an entry whose rows it only partly uses (a carved-out sink) kept the
        # rest from eviction and could starve the sequence's own decoding of rows.
        planner.release(plan)
        for c in plan.chunks:  # the chunks this sequence is about to compute
            if c.fingerprint not in self.registry:
                self.inflight[c.fingerprint] = self.inflight.get(c.fingerprint, 0) + 1
        st = plan.stats
        seq.admit(slots, np.asarray(plan.compute_positions(), dtype=np.int64), plan,
                  dict(prompt_tokens=st.prompt_tokens, prefix_tokens=st.prefix_tokens,
                       reused_tokens=st.reused_tokens, computed_tokens=st.computed_tokens,
                       carve_out_tokens=st.carve_out_tokens, s1_tokens=st.s1_tokens))

    def share_prompt(self, seq: Sequence, lead: Sequence) -> None:
        """Another choice of lead's prompt: one more reference on each of its prompt rows but the last,
        whose logits start this choice and which it computes. Counted as prefix tokens."""
        n = seq.prompt_len - 1
        slots = np.zeros(seq.prompt_len, np.int64)
        slots[:n] = lead.slots[:n]
        self.pool.retain(slots[:n])
        seq.admit(slots, np.array([n], np.int64), None,
                  dict(prompt_tokens=seq.prompt_len, prefix_tokens=n, reused_tokens=0, computed_tokens=1,
                       carve_out_tokens=0, s1_tokens=0))

    def recompute(self, seq: Sequence, positions: np.ndarray) -> None:
        """pic+r: give up the reused rows at positions; they are computed in this context instead."""
        self.pool.release(seq.slots[positions])
        seq.recompute(positions)

    def allocate(self, seq: Sequence, positions: np.ndarray) -> bool:
        """Fresh slots for positions of seq (rows it computes), evicting cached rows if needed;
        False (nothing taken) if the pool cannot give them."""
        if not len(positions):
            return True
        slots = self.take(len(positions), [seq.tenant])
        if slots is None:
            return False
        seq.place(positions, slots)
        self.pool.computed_at[slots] = positions
        return True

    def append_slots(self, seqs: list[Sequence]) -> bool:
        """A slot for each decoding sequence's newest token; False (nothing taken) if the pool
        cannot give them all."""
        need = []
        for seq in seqs:
            if not seq.in_prefill:
                seq.grow()
                if seq.slots[-1] == EMPTY_SLOT:
                    need.append(seq)
        if not need:
            return True
        slots = self.take(len(need), [seq.tenant for seq in need])
        if slots is None:
            return False
        for seq, slot in zip(need, slots):
            seq.place(np.array([len(seq.tokens) - 1]), np.array([slot]))
            self.pool.computed_at[slot] = len(seq.tokens) - 1
        return True

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

        def first_gone(value) -> int | None:
            hit = np.flatnonzero(gone[np.asarray(value, np.int64)])
            return int(hit[0]) if len(hit) else None

        # (a key's salt token names the empty slot: a tenant's key whose every row went goes whole)
        self.radix.cut(first_gone, hollow=lambda value: not np.any(np.asarray(value) != EMPTY_SLOT))
        memory = self._memory
        if entries := [e for e in memory.entries() if len(e.payload)]:
            starts = np.cumsum([0] + [len(e.payload) for e in entries[:-1]])
            named = np.add.reduceat(gone[np.concatenate([e.payload for e in entries])].astype(np.int32), starts)
            for i in np.flatnonzero(named):
                memory.discard(entries[i].fingerprint)
        self.evicted_rows += self.pool.free - free
        return self.pool.free >= n

    def _in_planning(self) -> np.ndarray:
        """A mask of the rows a plan in progress holds (pinned entries, locked prefixes): a lower
        tier's hit is promoted, and may need room, while its plan is being made."""
        mask = np.zeros(self.pool.n_slots, bool)
        for value in self.radix.locked_values():
            mask[np.asarray(value, np.int64)] = True
        for e in self._memory.pinned_entries():
            mask[np.asarray(e.payload, np.int64)] = True
        return mask

    def _within_share(self, for_tenants) -> np.ndarray | None:
        """A mask of the rows of every owner but the requesters whose cached rows fit in its share of
        the pool; None if there are none. NOTE: O(cached entries and tree nodes) per call; it runs
        only when a share is set and the pool is short."""
        requesters = {owner_of(self.namespaces.resolve(t)) for t in (for_tenants or [None])}
        budget = self.tenant_share * (self.pool.n_slots - 1)
        rows = [r for r in self.namespaces.held_rows(self._memory.entries(), requesters).values() if len(r) <= budget]
        if not rows:
            return None
        mask = np.zeros(self.pool.n_slots, bool)
        mask[np.concatenate(rows)] = True
        return mask

    # -- the store tiers: the pool's offload ----------------------------------------------

    def _to_lower(self, entry: Entry) -> Entry:
        """A memory entry (slots) as the disk and Redis tiers store it: its rows, read from the pool."""
        return Entry(entry.fingerprint, entry.token_ids, entry.base_pos, self.pool.read_host(entry.payload),
                     entry.nbytes, entry.namespace)

    def _promote(self, entry: Entry) -> Entry | None:
        """A lower tier's hit (rows) into the pool and the memory tier; None if there is no room."""
        n = len(entry.token_ids)
        slots = self.take(n)
        if slots is None:
            return None
        self.pool.write(slots, entry.payload, entry.base_pos + np.arange(n))
        promoted = Entry(entry.fingerprint, entry.token_ids, entry.base_pos, slots, entry.nbytes, entry.namespace)
        stored = self.registry.memory.put(promoted)  # the memory tier takes its own reference
        self.pool.release(slots)  # ours: if the memory tier refused, the slots are free again
        return promoted if stored else None

    def prefetch(self, tokens: list[int], segment_starts, tenant: str | None) -> int:
        """Read this prompt's chunks from the disk and Redis tiers ahead of its admission, into the
        tiered registry's staging area. Pure of engine state: safe on any thread."""
        if not self.content_reuse or not hasattr(self.registry, "prefetch"):
            return 0
        ids = np.asarray(tokens, dtype=np.int64)
        wanted = []
        for name in dict.fromkeys([self.namespaces.resolve(tenant), SHARED]):
            seed, namespace = self.namespaces.ids(name)
            wanted += [(c.fingerprint, ids[c.start : c.end], namespace)
                       for c in chunk(ids, self.planner_config.chunker, seed, segment_starts)]
        return self.registry.prefetch(wanted)

    # -- as rows appear, and when a sequence ends -----------------------------------------

    def computed(self, seq: Sequence) -> None:
        """Offer the chunks whose rows now all exist to the registry (in-flight reuse)."""
        done = int(seq.pending[0]) if seq.in_prefill else seq.prompt_len
        if done > seq.registered and seq.reuse_plan is not None and self.content_reuse:
            self._register(self.planner(seq.tenant), seq.reuse_plan, seq.slots, upto=done)
            seq.registered = done

    def free(self, seq: Sequence, cache: bool = True) -> None:
        """The sequence gives its rows back. With `cache` (and a sequence that did not abort), its
        chunks and tokens are offered to the cache first (`offer`). Its plan's in-flight claims end
        either way."""
        try:
            if self.caching and cache and seq.finish_reason != "abort":
                self.offer(seq)
        finally:
            self._end_claims(seq)
            self.pool.release(seq.slots)
            seq.release()

    def offer(self, seq: Sequence) -> None:
        """Register every chunk of the sequence's computed rows (prompt and output) and insert its
        tokens into the tree; both take their own references, the sequence keeps its own. (A
        sequence in another engine over the same pool may be offered too: the evaluations share
        one computed prompt between strategies.)"""
        if not self.caching or not (n := seq.filled):
            return
        planner = self.planner(seq.tenant)
        tokens = np.asarray(seq.tokens[:n], dtype=np.int64)
        slots = seq.slots[:n]
        if self.content_reuse:
            self._register(planner, tokens, slots, segment_starts=seq.segment_starts)
        planner.radix.insert(tokens, slots)
        self.order.touch(slots[slots != EMPTY_SLOT])

    def _end_claims(self, seq: Sequence) -> None:
        plan = seq.reuse_plan
        if plan is None:
            return
        for c in plan.chunks:
            if c.fingerprint in self.inflight:
                self.inflight[c.fingerprint] -= 1
                if self.inflight[c.fingerprint] <= 0:
                    del self.inflight[c.fingerprint]

    def publish(self, tokens: np.ndarray, slots: np.ndarray, segment_starts=None):
        """Chunks of a document computed in the trusted publishing context, into the shared namespace."""
        if not self.content_reuse:
            raise RequestError(f"publishing needs content reuse (pic or naive); this engine runs {self.mode}")
        return self._register(self.planner(SHARED), tokens, slots, segment_starts=segment_starts)

    def _register(self, planner: Planner, plan_or_tokens: Plan | np.ndarray, slots: np.ndarray,
                  segment_starts=None, upto=None):
        # An entry's payload is its slots; the registry's on_store / on_evict count their references.
        return planner.register(plan_or_tokens, rows_of=lambda a, b: slots[a:b].copy(),
                                nbytes_of=lambda k: k * self.pool.bytes_per_slot,
                                segment_starts=segment_starts, upto=upto)

    def clear(self) -> None:
        """Evict every unpinned entry and unlocked prefix (their references go back to the pool)."""
        if self.caching:
            self.radix.evict(UNBOUNDED)
            self.registry.evict(UNBOUNDED)

    @property
    def cached_slots(self) -> np.ndarray:
        """Distinct slots the tree and the registry hold (for the pool's statistics)."""
        return np.flatnonzero(self.order.held > 0)
