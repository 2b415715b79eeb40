"""Per-tier counters, read by /metrics (one row per tier: memory, disk, redis), and each tier's log."""

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
    failures: int = (
        0  # operations that failed (I/O error, backend unreachable, write refused): each a miss or a skipped write
    )
    dropped: int = 0  # writes skipped (a failure, backend down or write queue full)
    pending: int = 0  # writes queued but not yet done
    available: bool = True  # False while a remote backend is down


def memory_tier_stats(registry) -> TierStats:
    s = registry.stats
    return TierStats("memory", s.hits, s.misses, s.evictions, s.insertions, s.entries, s.bytes, s.budget_bytes)


class TierLog:
    """One tier's warnings (entries that failed verification, operations that failed), at most one
    line per `interval` seconds per tier, with the number of those it held back: a disk that fails
    every read, or a flood of corrupt entries, costs one line per interval, not one per lookup."""

    def __init__(self, tier: str, interval: float = 10.0):
        self.tier, self.interval = tier, interval
        self._last, self._held = float("-inf"), 0
        self._lock = threading.Lock()

    def corrupt(self, fingerprint: int, reason: str) -> None:
        self._warn("entry %016x failed verification and was dropped: %s", fingerprint, reason)

    def failed(self, what: str, error: BaseException) -> None:
        self._warn("%s failed (%s); served as a miss or skipped", what, _describe(error))

    def _warn(self, message: str, *args) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        more = f" ({held} more since the last report)" if held else ""
        log.warning("%s tier: " + message + "%s", self.tier, *args, more)


def _describe(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return f"{type(error).__name__}: {error.strerror}"
    return f"{type(error).__name__}: {error}"[:300]
