"""Memory -> disk -> Redis behind one ``Registry``: reads fall through, hits are promoted.

A lookup tries the in-process memory tier first, then each lower tier in order; a verified hit in
a lower tier is copied into every tier above it, so hot entries move towards the engine. Writes
go to every tier (Redis's are queued in the background). Membership (``in``) and ``peek`` see the
memory tier only: ``register`` then always fills the local tier and its S1 window index, and the
window index stays in step with the memory tier through ``on_evict``.

Pins protect memory entries; an entry that could not be promoted (memory full of pinned rows) is
still served, and its pin is a counted no-op: the engine copies rows before it uses them.
"""

from __future__ import annotations

import numpy as np

from irminsul.cache.registry import Entry, MemoryRegistry, PinCounts, Registry, RegistryStats
from irminsul.cache.store.stats import TierStats, memory_tier_stats


class TieredRegistry(Registry):
    def __init__(self, memory: MemoryRegistry, lower: list[Registry]):
        super().__init__()
        self.memory, self.lower = memory, list(lower)
        self.on_evict = memory.on_evict  # NOTE: shared list: window indexes follow the memory tier
        self._phantom = PinCounts()  # pins of entries that are not in memory
        self._hits = self._misses = 0

    def get(self, fingerprint: int, token_ids: np.ndarray) -> Entry | None:
        entry = self.memory.get(fingerprint, token_ids)
        if entry is None:
            for i, tier in enumerate(self.lower):
                entry = tier.get(fingerprint, token_ids)
                if entry is not None:
                    self._promote(entry, i)
                    break
        self._hits += entry is not None
        self._misses += entry is None
        return entry

    def _promote(self, entry: Entry, found_in: int) -> None:
        self.memory.put(entry)
        for tier in self.lower[:found_in]:
            tier.put(entry)

    def peek(self, fingerprint: int) -> Entry | None:
        return self.memory.peek(fingerprint)

    def put(self, entry: Entry) -> bool:
        stored = self.memory.put(entry)
        for tier in self.lower:
            tier.put(entry)  # lower tiers keep the first copy of a fingerprint (disk: skip, Redis: SET NX)
        return stored

    def pin(self, fingerprint: int) -> None:
        if fingerprint in self.memory:
            self.memory.pin(fingerprint)
        else:
            self._phantom.add(fingerprint)

    def unpin(self, fingerprint: int) -> None:
        if fingerprint in self._phantom:
            self._phantom.remove(fingerprint)
        else:
            self.memory.unpin(fingerprint)

    def __contains__(self, fingerprint: int) -> bool:
        return fingerprint in self.memory

    def __len__(self) -> int:
        return len(self.memory)

    @property
    def stats(self) -> RegistryStats:
        m = self.memory.stats
        collisions = m.collisions + sum(t.stats.collisions for t in self.lower)
        return RegistryStats(self._hits, self._misses, collisions, m.evictions, m.insertions, m.rejected,
                             m.entries, m.pinned, m.bytes, m.budget_bytes)

    @property
    def all_tier_stats(self) -> list[TierStats]:
        return [memory_tier_stats(self.memory), *(t.tier_stats for t in self.lower)]

    def close(self) -> None:
        for tier in self.lower:
            if hasattr(tier, "close"):
                tier.close()
