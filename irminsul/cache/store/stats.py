"""Per-tier counters, read by /metrics (one row per tier: memory, disk, redis)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierStats:
    tier: str
    hits: int
    misses: int
    evictions: int
    insertions: int
    entries: int
    bytes: int
    budget_bytes: int  # 0 when the tier has no budget of its own (Redis: its maxmemory policy)
    corrupt: int = 0  # entries that failed verification and were dropped
    failures: int = 0  # operations that failed because the backend was unreachable
    dropped: int = 0  # writes skipped (backend down or write queue full)
    pending: int = 0  # writes queued but not yet done
    available: bool = True  # False while a remote backend is down


def memory_tier_stats(registry) -> TierStats:
    s = registry.stats
    return TierStats("memory", s.hits, s.misses, s.evictions, s.insertions, s.entries, s.bytes, s.budget_bytes)
