"""Memory -> disk -> Redis behind one ``Registry``: reads fall through, hits are promoted.

A lookup tries the in-process memory tier first, then each lower tier in order; a verified hit in
a lower tier is copied into every tier above it, so hot entries move towards the engine. Writes
go to every tier, on a background writer thread (encoding and file or network writes never sit
on the thread that decodes; a full write queue drops the write and counts it), so content the
memory tier evicts is still found below it. Membership (``in``) and ``peek`` see the memory tier only: ``register``
then always fills the local tier and its S1 window index, and the window index stays in step with
the memory tier through ``on_evict``.

The tiers may hold different payloads: the engine's memory tier holds pool slots, the lower tiers
hold the rows themselves. ``bind(promote, to_lower)`` says how to move between them: ``to_lower``
turns a memory entry into what the lower tiers store, ``promote`` brings a lower tier's entry into
the memory tier (returning the memory entry, or None when there is no room: a miss). Unbound, both
tiers hold the same payload.

``prefetch`` reads lower-tier entries ahead of the lookup that will want them, on any thread (the
server calls it from a worker as a request arrives, so disk and Redis reads never sit on the
thread that decodes); ``get`` then takes a staged entry without I/O. The staging area is bounded.

Pins protect memory entries; a pin on an entry that is not in memory is a counted no-op.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from irminsul.cache.registry import Entry, MemoryRegistry, PinCounts, Registry, RegistryStats
from irminsul.cache.store.stats import TierStats, memory_tier_stats


class TieredRegistry(Registry):
    def __init__(self, memory: MemoryRegistry, lower: list[Registry]):
        super().__init__()
        self.memory, self.lower = memory, list(lower)
        # NOTE: shared lists: window indexes and slot references follow the memory tier
        self.on_store, self.on_evict = memory.on_store, memory.on_evict
        self._phantom = PinCounts()  # pins of entries that are not in memory
        self._hits = self._misses = 0
        self._promote: Callable[[Entry], Entry | None] = self._put_in_memory
        self._to_lower: Callable[[Entry], Entry] = lambda entry: entry
        self._staged: OrderedDict[int, tuple[int, Entry]] = OrderedDict()  # fingerprint -> (tier, entry)
        self._staged_lock = threading.Lock()
        self.max_staged = 4096
        self._writes: queue.Queue = queue.Queue(1024)
        self._writer: threading.Thread | None = None
        self.dropped_writes = 0

    def bind(self, promote: Callable[[Entry], Entry | None], to_lower: Callable[[Entry], Entry]) -> None:
        self._promote, self._to_lower = promote, to_lower

    def _put_in_memory(self, entry: Entry) -> Entry:
        self.memory.put(entry)
        return entry

    def prefetch(self, wanted: list[tuple[int, np.ndarray]]) -> int:
        """Stage the lower tiers' entries for (fingerprint, token ids) pairs the memory tier lacks;
        returns how many were found. Safe to call from any thread."""
        found = 0
        for fingerprint, token_ids in wanted:
            if fingerprint in self.memory or fingerprint in self._staged:
                continue
            for i, tier in enumerate(self.lower):
                entry = tier.get(fingerprint, token_ids)
                if entry is not None:
                    with self._staged_lock:
                        self._staged[fingerprint] = (i, entry)
                        while len(self._staged) > self.max_staged:
                            self._staged.popitem(last=False)
                    found += 1
                    break
        return found

    def _staged_entry(self, fingerprint: int, token_ids: np.ndarray) -> tuple[int, Entry] | None:
        with self._staged_lock:
            staged = self._staged.pop(fingerprint, None)
        if staged is not None and np.array_equal(staged[1].token_ids, token_ids):
            return staged
        return None

    def get(self, fingerprint: int, token_ids: np.ndarray) -> Entry | None:
        entry = self.memory.get(fingerprint, token_ids)
        if entry is None:
            staged = self._staged_entry(fingerprint, token_ids)
            tiers = [(staged[0], staged[1])] if staged else ((i, t.get(fingerprint, token_ids))
                                                              for i, t in enumerate(self.lower))
            for i, found in tiers:
                if found is not None:
                    for upper in self.lower[:i]:
                        upper.put(found)
                    entry = self._promote(found)
                    break
        self._hits += entry is not None
        self._misses += entry is None
        return entry

    def peek(self, fingerprint: int) -> Entry | None:
        return self.memory.peek(fingerprint)

    def put(self, entry: Entry) -> bool:
        stored = self.memory.put(entry)
        if self.lower:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="irminsul-store-writer", daemon=True)
                self._writer.start()
            try:
                self._writes.put_nowait(self._to_lower(entry))
            except queue.Full:
                self.dropped_writes += 1
        return stored

    def _write_loop(self) -> None:
        while True:
            below = self._writes.get()
            try:
                if below is None:
                    return
                for tier in self.lower:
                    tier.put(below)  # lower tiers keep the first copy of a fingerprint (disk: skip, Redis: SET NX)
            except Exception:  # a broken tier costs reuse, never the server
                import logging

                logging.getLogger("irminsul.store").exception("writing an entry to a lower tier failed")
            finally:
                self._writes.task_done()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued lower-tier writes are written (tests, shutdown); False on timeout."""
        import time

        end = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.01)
        return not self._writes.unfinished_tasks

    def evict(self, nbytes: int) -> int:
        return self.memory.evict(nbytes)

    def entries(self) -> list[Entry]:
        return self.memory.entries()

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
        self.flush()
        if self._writer is not None:
            self._writes.put(None)
        for tier in self.lower:
            if hasattr(tier, "flush"):
                tier.flush()
            if hasattr(tier, "close"):
                tier.close()
