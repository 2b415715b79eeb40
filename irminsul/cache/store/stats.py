"""Per-tier counters, read by /metrics (one row per tier: memory, disk, redis)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("irminsul.store")


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


class CorruptionLog:
    """Logs entries that fail verification, at most one line per `interval` seconds per tier, with
    the number of those it held back, so a flood of corrupt entries cannot flood the log."""

    def __init__(self, tier: str, interval: float = 10.0):
        self.tier, self.interval = tier, interval
        self._last, self._held = float("-inf"), 0
        self._lock = threading.Lock()

    def __call__(self, fingerprint: int, reason: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        more = f" ({held} more since the last report)" if held else ""
        log.warning("%s tier: entry %016x failed verification and was dropped: %s%s", self.tier, fingerprint,
                    reason, more)
