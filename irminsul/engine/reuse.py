"""Executes the cache's plans on the latent pool ([design](../../docs/design.md), sections 3 and 4).

  off     every prompt token is computed (the quality reference);
  prefix  exact-prefix rows from the radix tree, shared as they are;
  naive   prefix + content-addressed chunks, `k_r` read at the position it was computed at (stale
          `k_r`: the paper's baseline), no sink carve-out;
  pic     prefix + content-addressed chunks with the sink carve-out; every row read at its position
          in the new sequence, which is the δ-rotation done when attention reads the key.

The planner is pure bookkeeping; this module turns a plan into a slot table. A hit never copies:
the radix tree and the registry hold slot references into the engine's pool, and a sequence that
reuses a chunk takes one more reference on its slots. Chunks are offered to the registry as soon
as their rows are computed (in-flight reuse), and a request whose chunks a running sequence is
computing right now waits for them instead of computing them again.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
from collections import OrderedDict

import numpy as np

from irminsul.cache.chunker import ChunkerConfig, chunk, namespace_seed
from irminsul.cache.planner import Planner, PlannerConfig
from irminsul.cache.radix import PrefixMatch, PrefixPiece, RadixCache
from irminsul.cache.registry import Entry, MemoryRegistry, ScopedRegistry, namespace_id
from irminsul.cache.windows import WindowIndex
from irminsul.engine.pool import LatentPool
from irminsul.engine.sequence import Sequence
from irminsul.errors import RequestError
from irminsul.model.attention import EMPTY_SLOT

MODES = ("off", "prefix", "naive", "pic")
SHARED = "\x00shared"  # the operator's published namespace; no request can name it as its tenant


def make_reuse(mode: str, pool: LatentPool, num_layers: int, **options):
    if mode not in MODES:
        raise RequestError(f"reuse={mode!r} is not a reuse mode; choose one of {', '.join(MODES)}")
    known = set(inspect.signature(CacheReuse.__init__).parameters) - {"self", "mode", "pool", "num_layers"}
    if unknown := sorted(set(options) - known):
        raise RequestError(f"unknown cache option {', '.join(unknown)}; the options are {', '.join(sorted(known))}")
    if mode == "off":
        return NoReuse(pool)  # cache options are accepted and ignored: nothing is cached
    return CacheReuse(mode, pool, num_layers, **options)


class NoReuse:
    mode = "off"
    recompute_ratio = 0.0

    def __init__(self, pool: LatentPool):
        self.pool = pool

    def prepare(self, seq: Sequence) -> None:
        n = len(seq.tokens)
        seq.slots = np.zeros(n, np.int64)
        seq.pending = np.arange(n, dtype=np.int64)
        seq.stats.prompt_tokens = seq.stats.computed_tokens = n

    def make_room(self, n: int, for_tenants=None) -> bool:
        return self.pool.free >= n

    def waits_for(self, tokens, segment_starts, tenant) -> bool:
        return False

    def prefetch(self, tokens, segment_starts, tenant) -> int:
        return 0

    def computed(self, seq: Sequence) -> None:
        pass

    def finish(self, seq: Sequence) -> None:
        pass

    @property
    def cached_slots(self) -> np.ndarray:
        return np.zeros(0, np.int64)

    def clear(self) -> None:
        pass


class SaltedRadix:
    """One tenant's view of the shared radix tree: every key starts with the tenant's salt token.

    The salt is a negative id, so it never equals a real token: tenants share one pool but can
    never match (or time) each other's prefixes. The salt's own slot is the pool's empty slot.
    """

    def __init__(self, radix: RadixCache, salt: int):
        self.radix, self.salt = radix, salt

    def match(self, tokens):
        m = self.radix.match(np.concatenate([[self.salt], np.asarray(tokens, dtype=np.int64)]))
        if m.length == 0:
            return PrefixMatch(0, m.node, [])
        first = PrefixPiece(m.values[0].value[1:], m.values[0].length - 1)
        return PrefixMatch(m.length - 1, m.node, [first, *m.values[1:]])

    def insert(self, tokens, slots: np.ndarray) -> int:
        salted = np.concatenate([[self.salt], np.asarray(tokens, dtype=np.int64)])
        return self.radix.insert(salted, np.concatenate([[EMPTY_SLOT], slots]))

    def lock(self, node) -> None:
        self.radix.lock(node)

    def unlock(self, node) -> None:
        self.radix.unlock(node)


def owner_of(tenant: str) -> str:
    """Whose namespace this is: the tenant a `|`-subdivision (the server's cache_salt) belongs to."""
    return tenant.split("|", 1)[0]


class CacheReuse:
    """The cache of one engine: a registry and a radix tree shared by all tenants, both holding slot
    references into the pool, and per tenant a namespace (fingerprint seed, radix salt, S1 window
    index), so nothing crosses tenants."""

    def __init__(self, mode: str, pool: LatentPool, num_layers: int, tenant: str = "", model_id: str = "",
                 carve_out: bool | None = None, s1: bool = True, registry=None, recompute_ratio: float = 0.0,
                 check_layer: int = 1, max_namespaces: int = 1024, marker: tuple[int, ...] | None = None,
                 tenant_share: float | None = None):
        self.mode, self.pool, self.model_id, self.default_tenant = mode, pool, model_id, tenant
        if tenant_share is not None and not (isinstance(tenant_share, (int, float)) and 0 < tenant_share <= 1):
            raise RequestError(f"tenant_share={tenant_share!r} must be a share of the pool in (0, 1]")
        self.tenant_share = tenant_share
        # The pool is the one budget: the registry and the tree are never the first to refuse.
        # NOTE: "is None", not "or": an empty registry has len 0 and is falsy.
        self.registry = registry if registry is not None else MemoryRegistry(pool.capacity_bytes)
        self.registry.on_store.append(lambda entry: pool.retain(entry.payload))
        self.registry.on_evict.append(lambda entry: pool.release(entry.payload))
        # one logical clock for the tree's nodes and the registry's entries: one eviction order
        self._clock = itertools.count(1)
        self._used: dict[int, int] = {}  # registry fingerprint -> when it was stored or last reused
        self.registry.on_store.append(lambda entry: self._used.__setitem__(entry.fingerprint, next(self._clock)))
        self.registry.on_evict.append(lambda entry: self._used.pop(entry.fingerprint, None))
        if hasattr(self.registry, "bind"):  # store tiers below memory hold rows, memory holds slots
            self.registry.bind(self._promote, self._to_lower)
        # NOTE: the tree counts tokens, not rows: each tenant's salt token and rows held under two
        # prefixes count twice, so a budget of the pool's size could bind before the pool and evict
        # by the tree's own order; twice the pool leaves every eviction to make_room's one order.
        self.radix = RadixCache(2 * pool.capacity_bytes, pool.bytes_per_slot, on_store=pool.retain,
                                on_evict=pool.release, clock=self._clock)
        if carve_out is None:
            carve_out = mode == "pic"  # the paper's naive baseline has no carve-out
        # marker: the paper's S2 variant, a model-visible boundary sequence that restarts chunking.
        chunker = ChunkerConfig(marker=tuple(marker) if marker else None)
        self.planner_config = PlannerConfig(chunker=chunker, content_reuse=mode != "prefix",
                                            s1=s1, carve_out=carve_out)
        self.namespaces: OrderedDict[str, Planner] = OrderedDict()  # LRU: untrusted salts can't grow it
        self.max_namespaces = max_namespaces
        if not 0.0 <= recompute_ratio <= 1.0:
            raise RequestError(f"recompute_ratio={recompute_ratio} must be in [0, 1]")
        if recompute_ratio and not 0 < check_layer < num_layers:
            raise RequestError(f"check_layer={check_layer} must be in [1, {num_layers - 1}]")
        self.recompute_ratio, self.check_layer = recompute_ratio, check_layer
        self.inflight: dict[int, int] = {}  # fingerprint -> running sequences that will compute it
        # tenant -> (its radix salt: the first token of its keys, its namespace id: what its entries record)
        self._names: dict[str, tuple[int, str]] = {}

    def namespace(self, tenant: str | None = None) -> Planner:
        """The planner of a tenant's namespace (created on first use)."""
        tenant = self.default_tenant if tenant is None else tenant
        if tenant not in self.namespaces:
            seed, name = namespace_seed(self.model_id, tenant), namespace_id(self.model_id, tenant)
            # a negative id (never a real token) from the BLAKE2b namespace digest, not the xxHash64
            # seed: a tenant who picks its cache_salt cannot search out another tenant's salt
            salt = -1 - (int(name[:16], 16) >> 2)
            self._names[tenant] = salt, name
            fallbacks = [] if tenant == SHARED else [self.namespace(SHARED)]
            # NOTE: a scoped view: every hit compares the namespace that wrote the entry, not only its fingerprint
            registry = ScopedRegistry(self.registry, name)
            self.namespaces[tenant] = Planner(self.planner_config, registry, SaltedRadix(self.radix, salt),
                                              WindowIndex(self.planner_config.window), seed=seed,
                                              fallbacks=fallbacks)
            self._drop_idle_namespaces()
        self.namespaces.move_to_end(tenant)
        return self.namespaces[tenant]

    def _drop_idle_namespaces(self) -> None:
        """Forget the least recently used namespaces beyond max_namespaces. Their registry entries
        and radix nodes stay and age out of the pool; only the S1 window index is lost."""
        for tenant in list(self.namespaces):
            if len(self.namespaces) <= self.max_namespaces:
                break
            if tenant != SHARED:
                self.namespaces.pop(tenant).close()
                self._names.pop(tenant, None)

    # -- the store tiers: the pool's offload ----------------------------------------------

    def _to_lower(self, entry: Entry) -> Entry:
        """A memory entry (slots) as the disk and Redis tiers store it: its rows, read from the pool."""
        return Entry(entry.fingerprint, entry.token_ids, entry.base_pos, self.pool.read_host(entry.payload),
                     entry.nbytes, entry.namespace)

    def _promote(self, entry: Entry) -> Entry | None:
        """A lower tier's hit (rows) into the pool and the memory tier; None if there is no room."""
        n = len(entry.token_ids)
        if not self.make_room(n):
            return None
        slots = self.pool.alloc(n)
        self.pool.write(slots, entry.payload, entry.base_pos + np.arange(n))
        promoted = Entry(entry.fingerprint, entry.token_ids, entry.base_pos, slots, entry.nbytes, entry.namespace)
        stored = self.registry.memory.put(promoted)  # the memory tier takes its own reference
        self.pool.release(slots)  # ours: if the memory tier refused, the slots are free again
        return promoted if stored else None

    def prefetch(self, tokens: list[int], segment_starts, tenant: str | None) -> int:
        """Read this prompt's chunks from the disk and Redis tiers ahead of its admission, into the
        tiered registry's staging area. Pure of engine state: safe on any thread."""
        if not hasattr(self.registry, "prefetch") or not self.planner_config.content_reuse:
            return 0
        ids = np.asarray(tokens, dtype=np.int64)
        tenant = self.default_tenant if tenant is None else tenant
        wanted = []
        for name in dict.fromkeys([tenant, SHARED]):
            seed, namespace = namespace_seed(self.model_id, name), namespace_id(self.model_id, name)
            wanted += [(c.fingerprint, ids[c.start : c.end], namespace)
                       for c in chunk(ids, self.planner_config.chunker, seed, segment_starts)]
        return self.registry.prefetch(wanted)

    # -- admission -------------------------------------------------------------------------

    def waits_for(self, tokens: list[int], segment_starts, tenant: str | None) -> bool:
        """True if a running sequence is computing one of this prompt's chunks right now: admitting
        the prompt after those rows exist reuses them instead of computing them again."""
        if not self.inflight or not self.planner_config.content_reuse:
            return False
        planner = self.namespace(tenant)
        return any(c.fingerprint in self.inflight and c.fingerprint not in self.registry
                   for c in planner.chunk(np.asarray(tokens, dtype=np.int64), segment_starts))

    def prepare(self, seq: Sequence) -> None:
        """Plan the prompt and point the slot table at the rows it reuses (one reference each)."""
        plan = self.namespace(seq.tenant).plan(np.asarray(seq.tokens, dtype=np.int64), seq.segment_starts)
        seq.plan = plan
        slots = np.zeros(len(seq.tokens), np.int64)
        prefix = np.concatenate([p.value[: p.length] for p in plan.prefix.values]) if plan.prefix.values else None
        for span in plan.spans:
            if span.kind == "prefix":
                slots[span.start : span.end] = prefix[span.start : span.end]
            elif span.kind == "reuse":
                slots[span.start : span.end] = span.entry.payload[span.src_offset : span.src_offset + len(span)]
                if span.entry.fingerprint in self._used:
                    self._used[span.entry.fingerprint] = next(self._clock)
        self.pool.retain(slots)
        # NOTE: the plan's pins and prefix lock kept its entries from eviction until now; the sequence
        # holds its own reference on every row it reuses from here, so they go now. Held until the
        # sequence finished, an entry whose rows it only partly uses (a carved-out sink) kept the
        # rest from eviction and could starve the sequence's own decoding of rows.
        self.namespace(seq.tenant).release(plan)
        seq.slots = slots
        seq.pending = np.asarray(plan.compute_positions(), dtype=np.int64)
        seq.registered = 0
        for c in plan.chunks:  # the chunks this sequence is about to compute
            if c.fingerprint not in self.registry:
                self.inflight[c.fingerprint] = self.inflight.get(c.fingerprint, 0) + 1
        st = plan.stats
        seq.stats.prompt_tokens, seq.stats.prefix_tokens = st.prompt_tokens, st.prefix_tokens
        seq.stats.reused_tokens, seq.stats.computed_tokens = st.reused_tokens, st.computed_tokens
        seq.stats.carve_out_tokens, seq.stats.s1_tokens = st.carve_out_tokens, st.s1_tokens

    def recompute(self, seq: Sequence, positions: np.ndarray) -> None:
        """pic+r: give up the reused rows at positions; they are computed in this context instead."""
        self.pool.release(seq.slots[positions])
        seq.slots[positions] = EMPTY_SLOT
        seq.pending = np.union1d(seq.pending, positions)
        seq.stats.recomputed_tokens = len(positions)
        seq.stats.reused_tokens -= len(positions)
        seq.stats.computed_tokens += len(positions)

    def make_room(self, n: int, for_tenants=None) -> bool:
        """Evict cached content nobody is using, least recently used first, until n slots are free.
        A slot is freed only when its last holder lets go, so evicting may free fewer slots than
        it names; the loop goes on while either structure still evicts something.

        With a `tenant_share`, room made for the sequences of `for_tenants` (None: the default
        tenant) comes first from their owners' own cached content and from owners holding more
        than their share of the pool; another owner's content within its share goes only when
        that is not enough."""
        if self.pool.free >= n:
            return True
        if self.tenant_share is not None:
            tenants = [self.default_tenant if t is None else t for t in (for_tenants or [None])]
            salts, namespaces = self._within_share({owner_of(t) for t in tenants})
            if (salts or namespaces) and self._evict_until(n, lambda first: first in salts,
                                                           lambda e: e.namespace in namespaces):
                return True
        return self._evict_until(n)

    def _evict_until(self, n: int, spare_prefix=None, spare_entry=None) -> bool:
        """Free slots until n are free, dropping the cache's holdings in one least-recently-used
        order over the tree's leaves and the registry's entries: a leaf gives its last rows first
        (as many as are still needed; its prefix keeps its head) together with the entries that
        hold them; a holding whose rows someone else also holds is passed over, since dropping it
        alone frees nothing. Only when that frees too little does each structure evict whole
        holdings by its own order."""
        if self.pool.free >= n:
            return True
        refs = self.pool.refs
        memory = getattr(self.registry, "memory", self.registry)  # (the tiers below hold no slots)
        entries = sorted((self._used.get(e.fingerprint, 0), e.fingerprint, e) for e in memory.entries()
                         if not memory.pinned(e.fingerprint) and not (spare_entry and spare_entry(e)))
        held = np.zeros(len(refs), np.int64)  # evictable registry references per slot
        for _, _, e in entries:
            np.add.at(held, np.asarray(e.payload, np.int64), 1)
        gone: set[int] = set()

        def drop(e) -> None:
            if e.fingerprint not in gone and memory.discard(e.fingerprint):
                np.subtract.at(held, np.asarray(e.payload, np.int64), 1)
            gone.add(e.fingerprint)

        leaves, i = self.radix.leaves(spare_prefix), 0
        while self.pool.free < n and (leaves or i < len(entries)):
            if leaves and (i >= len(entries) or leaves[0].last_access <= entries[i][0]):
                leaf = heapq.heappop(leaves)
                tail = np.asarray(leaf.value, np.int64)[-(n - self.pool.free):]
                if not (refs[tail] == 1 + held[tail]).any():  # someone else holds every row
                    continue
                whole = len(tail) >= len(leaf.key)
                _, parent = self.radix.trim(leaf, len(tail))
                if not whole:
                    heapq.heappush(leaves, leaf)  # what is left of it is still the oldest
                elif parent is not None:
                    heapq.heappush(leaves, parent)
                if held[tail].any():  # the registry's references on those rows go with them
                    rows = set(tail.tolist())
                    for _, _, e in entries:
                        if e.fingerprint not in gone and rows.intersection(np.asarray(e.payload).tolist()):
                            drop(e)
            else:
                _, _, e = entries[i]
                i += 1
                if e.fingerprint not in gone and (refs[np.asarray(e.payload, np.int64)] == 1).any():
                    drop(e)
        while self.pool.free < n:
            need = (n - self.pool.free) * self.pool.bytes_per_slot
            if not (self.radix.evict(need, spare_prefix) or self.registry.evict(need, spare_entry)):
                return False
        return True

    def _within_share(self, requesters: set[str]) -> tuple[set[int], set[str]]:
        """The radix salts and registry namespaces of every owner but the requesters whose cached
        rows (distinct slots in the tree and the registry) fit in its share of the pool.
        NOTE: O(cached entries and tree nodes) per call; it runs only when a share is set and the
        pool is short."""
        owners: dict[str, list[str]] = {}
        for tenant in self.namespaces:
            if tenant != SHARED and owner_of(tenant) not in requesters:
                owners.setdefault(owner_of(tenant), []).append(tenant)
        if not owners:
            return set(), set()
        by_namespace: dict[str, list[np.ndarray]] = {}
        for e in self.registry.entries():
            by_namespace.setdefault(e.namespace, []).append(np.asarray(e.payload))
        budget = self.tenant_share * (self.pool.n_slots - 1)
        salts, namespaces = set(), set()
        for tenants in owners.values():
            names = [self._names[t][1] for t in tenants]
            held = [np.asarray(v) for t in tenants for v in self.radix.values_under(self._names[t][0])]
            held += [p for name in names for p in by_namespace.get(name, [])]
            rows = np.unique(np.concatenate(held)) if held else np.zeros(0, np.int64)
            if int((rows != EMPTY_SLOT).sum()) <= budget:
                salts.update(self._names[t][0] for t in tenants)
                namespaces.update(names)
        return salts, namespaces

    # -- as rows appear ----------------------------------------------------------------------

    def computed(self, seq: Sequence) -> None:
        """Offer the chunks whose rows now all exist to the registry (in-flight reuse)."""
        done = int(seq.pending[0]) if seq.in_prefill else seq.prompt_len
        if done > seq.registered and seq.plan is not None and self.planner_config.content_reuse:
            self._register(self.namespace(seq.tenant), seq.plan, seq.slots, upto=done)
            seq.registered = done

    def finish(self, seq: Sequence) -> None:
        """Register every chunk of the sequence (prompt and output) and insert it into the tree;
        release the plan's pins and its in-flight claims. The sequence keeps its own references."""
        planner = self.namespace(seq.tenant)
        try:
            n = seq.filled
            if n and seq.finish_reason != "abort":
                tokens = np.asarray(seq.tokens[:n], dtype=np.int64)
                slots = seq.slots[:n]
                if self.planner_config.content_reuse:
                    self._register(planner, tokens, slots, segment_starts=seq.segment_starts)
                planner.radix.insert(tokens, slots)
        finally:
            if seq.plan is not None:
                for c in seq.plan.chunks:
                    if c.fingerprint in self.inflight:
                        self.inflight[c.fingerprint] -= 1
                        if self.inflight[c.fingerprint] <= 0:
                            del self.inflight[c.fingerprint]
                planner.release(seq.plan)
                seq.plan = None

    def register_published(self, tokens: np.ndarray, slots: np.ndarray, segment_starts=None):
        """Chunks of a document computed in the trusted publishing context, into the shared namespace."""
        return self._register(self.namespace(SHARED), tokens, slots, segment_starts=segment_starts)

    def _register(self, planner: Planner, plan_or_tokens, slots: np.ndarray, segment_starts=None, upto=None):
        # An entry's payload is its slots; the registry's on_store / on_evict count their references.
        return planner.register(plan_or_tokens, rows_of=lambda a, b: slots[a:b].copy(),
                                nbytes_of=lambda k: k * self.pool.bytes_per_slot,
                                segment_starts=segment_starts, upto=upto)

    def clear(self) -> None:
        """Evict every unpinned entry and unlocked prefix (their references go back to the pool)."""
        everything = 2**62
        self.radix.evict(everything)
        self.registry.evict(everything)

    @property
    def cached_slots(self) -> np.ndarray:
        """Distinct slots the tree and the registry hold (for the pool's statistics)."""
        parts = self.radix.values()
        parts += [e.payload for e in self.registry.entries()]
        slots = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        return slots[slots != EMPTY_SLOT]
