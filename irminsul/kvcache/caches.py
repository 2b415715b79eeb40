"""What a reuse mode caches: the structures that name pool rows, which the KV manager (the rows'
owner, `manager.py`) consults and evicts through.

  NoCache     reuse=off: nothing is named, every prompt token is computed (the quality reference);
  ReuseCache  prefix / naive / pic: the exact-prefix radix tree, plus, except with prefix, the
              content registry (and its store tiers), over tenants' namespaces.

Both hold no slots of their own: the tree's and the registry's references on rows go through the
`hold` / `unhold` callables the manager gives, so that one eviction order covers them both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from irminsul.kvcache.chunker import Chunk, ChunkerConfig, chunk
from irminsul.kvcache.config import KVCacheConfig
from irminsul.kvcache.journal import ChunkJournal
from irminsul.kvcache.namespaces import SHARED, Namespaces, owner_of
from irminsul.kvcache.planner import Plan, PlannerConfig, Registered
from irminsul.kvcache.radix import RadixCache, RadixStats
from irminsul.kvcache.registry import ChunkStore, Entry, MemoryRegistry, slots_of
from irminsul.model.attention import EMPTY_SLOT

UNBOUNDED = 2**62  # the tree's and the registry's own byte budgets: the pool is the one budget


class ChunkNaming(NamedTuple):
    """What another process needs to fingerprint chunks as this cache does (a fleet router)."""

    model_id: str
    default_tenant: str
    marker: tuple[int, ...] | None
    sink: int
    store_prefix: str | None  # the shared store's key prefix (not a secret: the model and the secret's id)


class Cache(ABC):
    """The interface the KV manager sees; one implementation per kind of reuse."""

    caching: bool  # anything is cached at all
    content_reuse: bool  # chunks are reused wherever they appear (not only as exact prefixes)
    sink: int = 0  # rows below this position are computed even when cached
    journal: ChunkJournal | None = None  # the chunks the pool holds, for a fleet router to follow

    @abstractmethod
    def plan(self, tokens: np.ndarray, segment_starts, tenant: str | None) -> Plan | None:
        """The plan of a prompt against the cache (None: every position is computed)."""

    def release(self, plan: Plan, tenant: str | None) -> None:  # noqa: B027 (a hook: a no-op without a cache)
        """The plan's pins and prefix locks go (its sequence holds its own references now)."""

    def chunks(self, tokens: np.ndarray, segment_starts, tenant: str | None) -> list[Chunk]:
        """The prompt's chunks as the tenant's planner cuts them (none without content reuse)."""
        return []

    def __contains__(self, fingerprint: int) -> bool:
        return False

    def register(
        self, tenant: str | None, plan_or_tokens, slots: np.ndarray, bytes_per_slot: int, segment_starts=None, upto=None
    ) -> Registered | None:
        """Chunks whose rows are `slots` into the tenant's namespace (with content reuse)."""
        return None

    def insert(self, tenant: str | None, tokens: np.ndarray, slots: np.ndarray) -> bool:
        """A finished sequence's tokens into the tree; False if nothing is cached."""
        return False

    def forget(self, gone: np.ndarray) -> None:  # noqa: B027 (a hook: a no-op without a cache)
        """Forget every name of the rows `gone` marks (a mask over the pool's slots)."""

    def in_planning(self, mask: np.ndarray) -> None:  # noqa: B027 (a hook: a no-op without a cache)
        """Mark in `mask` the rows a plan in progress holds (pinned entries, locked prefixes)."""

    def held_rows(self, exclude_owners: set[str]) -> dict[str, np.ndarray]:
        return {}

    def owner(self, tenant: str | None) -> str:
        return ""

    def prefetch(self, tokens: np.ndarray, segment_starts, tenant: str | None) -> int:
        return 0

    def clear(self) -> None:  # noqa: B027 (a hook: a no-op without a cache)
        """Evict every unpinned entry and unlocked prefix."""

    @property
    def prefix_stats(self) -> RadixStats | None:
        return None

    @property
    def naming(self) -> ChunkNaming | None:
        return None


class NoCache(Cache):
    caching = content_reuse = False

    def plan(self, tokens, segment_starts, tenant) -> None:
        return None


class ReuseCache(Cache):
    caching = True
    journal: ChunkJournal  # (always one: the chunks its registry's memory tier holds)

    def __init__(
        self,
        config: KVCacheConfig,
        bytes_per_slot: int,
        registry: ChunkStore | None,
        hold: Callable[[np.ndarray], None],
        unhold: Callable[[np.ndarray], None],
        promote: Callable[[Entry], Entry | None],
        to_lower: Callable[[Entry], Entry],
    ):
        """`registry`: the content registry (the store tiers' `TieredRegistry`, say); an in-memory one
        by default. `hold` / `unhold`: a structure takes / drops its reference on rows. `promote` /
        `to_lower`: a lower tier's entry into the pool, and a memory entry's rows out of it."""
        mode = config.reuse
        # NOTE: "is None", not "or": an empty registry has len 0 and is falsy.
        self.registry: ChunkStore = registry if registry is not None else MemoryRegistry(UNBOUNDED)
        self.registry.on_store.append(lambda entry: hold(slots_of(entry)))
        self.registry.on_evict.append(lambda entry: unhold(slots_of(entry)))
        self.journal = ChunkJournal()
        self.registry.on_store.append(lambda entry: self.journal.added(entry.fingerprint))
        self.registry.on_evict.append(lambda entry: self.journal.removed(entry.fingerprint))
        self.registry.bind(promote, to_lower)  # store tiers below memory hold rows, memory holds slots
        self.radix = RadixCache(UNBOUNDED, bytes_per_slot, on_store=hold, on_evict=unhold)
        carve_out = mode == "pic" if config.carve_out is None else config.carve_out  # (naive: the paper's, none)
        self.planner_config = PlannerConfig(
            chunker=ChunkerConfig(marker=config.marker),
            content_reuse=mode != "prefix",
            s1=config.s1,
            carve_out=carve_out,
        )
        self.content_reuse, self.sink = self.planner_config.content_reuse, self.planner_config.sink
        self.namespaces = Namespaces(
            self.planner_config, self.registry, self.radix, config.model_id, config.tenant, config.max_namespaces
        )

    def planner(self, tenant: str | None):
        return self.namespaces.planner(tenant)

    def plan(self, tokens, segment_starts, tenant) -> Plan:
        return self.planner(tenant).plan(tokens, segment_starts)

    def release(self, plan: Plan, tenant: str | None) -> None:
        self.planner(tenant).release(plan)

    def chunks(self, tokens, segment_starts, tenant) -> list[Chunk]:
        return self.planner(tenant).chunk(tokens, segment_starts) if self.content_reuse else []

    def __contains__(self, fingerprint: int) -> bool:
        return fingerprint in self.registry

    def register(self, tenant, plan_or_tokens, slots, bytes_per_slot, segment_starts=None, upto=None):
        if not self.content_reuse:
            return None
        # An entry's payload is its slots; the registry's on_store / on_evict count their references.
        return self.planner(tenant).register(
            plan_or_tokens,
            rows_of=lambda a, b: slots[a:b].copy(),
            nbytes_of=lambda k: k * bytes_per_slot,
            segment_starts=segment_starts,
            upto=upto,
        )

    def insert(self, tenant, tokens, slots) -> bool:
        self.planner(tenant).radix.insert(tokens, slots)
        return True

    def forget(self, gone: np.ndarray) -> None:
        def first_gone(value) -> int | None:
            hit = np.flatnonzero(gone[np.asarray(value, np.int64)])
            return int(hit[0]) if len(hit) else None

        # (a key's salt token names the empty slot: a tenant's key whose every row went goes whole)
        self.radix.cut(first_gone, hollow=lambda value: not np.any(np.asarray(value) != EMPTY_SLOT))
        memory = self.registry.memory
        if entries := [e for e in memory.entries() if len(slots_of(e))]:
            starts = np.cumsum([0] + [len(slots_of(e)) for e in entries[:-1]])
            named = np.add.reduceat(gone[np.concatenate([slots_of(e) for e in entries])].astype(np.int32), starts)
            for i in np.flatnonzero(named):
                memory.discard(entries[i].fingerprint)

    def in_planning(self, mask: np.ndarray) -> None:
        for value in self.radix.locked_values():
            mask[np.asarray(value, np.int64)] = True
        for e in self.registry.memory.pinned_entries():
            mask[np.asarray(e.payload, np.int64)] = True

    def held_rows(self, exclude_owners: set[str]) -> dict[str, np.ndarray]:
        return self.namespaces.held_rows(self.registry.memory.entries(), exclude_owners)

    def owner(self, tenant: str | None) -> str:
        return owner_of(self.namespaces.resolve(tenant))

    def prefetch(self, tokens, segment_starts, tenant) -> int:
        if not self.content_reuse or not self.registry.lower:  # (memory alone: nothing to read ahead)
            return 0
        wanted = []
        for name in dict.fromkeys([self.namespaces.resolve(tenant), SHARED]):
            seed, namespace = self.namespaces.ids(name)
            wanted += [
                (c.fingerprint, tokens[c.start : c.end], namespace)
                for c in chunk(tokens, self.planner_config.chunker, seed, segment_starts)
            ]
        return self.registry.prefetch(wanted)

    def clear(self) -> None:
        self.radix.evict(UNBOUNDED)
        self.registry.evict(UNBOUNDED)

    @property
    def prefix_stats(self) -> RadixStats:
        return self.radix.stats

    @property
    def naming(self) -> ChunkNaming:
        return ChunkNaming(
            self.namespaces.model_id,
            self.namespaces.default_tenant,
            self.planner_config.chunker.marker,
            self.sink,
            self.registry.key_prefix,
        )
