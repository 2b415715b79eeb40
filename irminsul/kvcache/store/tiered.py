"""Memory -> disk -> Redis behind one ``Registry``: reads fall through, hits are promoted.

A lookup tries the in-process memory tier first, then each lower tier in order; a verified hit in
a lower tier is promoted into the memory tier and queued for the lower tiers above it, so hot
entries move towards the engine. Writes go to every tier, on a background writer thread (encoding
and file or network writes never sit on the thread that decodes; a full write queue drops the
write and counts it), so content the memory tier evicts is still found below it.

A lower tier that fails never fails a lookup or a write: whatever a tier raises is a miss (or a
skipped write), counted in that tier's ``failures`` and logged at most once per interval per tier.
The disk and Redis tiers turn their own I/O errors into misses; this is the backstop for
anything else they, or a tier of another kind, raise. Membership (``in``) and ``peek`` see the memory tier only: ``register``
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

import dataclasses
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from irminsul.kvcache.registry import Entry, MemoryRegistry, PinCounts, Registry, RegistryStats
from irminsul.kvcache.store.stats import TierLog, TierStats, memory_tier_stats


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
        self._writes: queue.Queue = queue.Queue(1024)  # (entry, indexes of the lower tiers to write it to)
        self._writer: threading.Thread | None = None
        self.dropped_writes = 0
        self._failures = [0] * len(self.lower)  # what each lower tier raised (its own stats do not see it)
        # one log per tier, shared with the tier's own, so a tier costs at most one line per interval
        self._logs = [t.log or TierLog(type(t).__name__) for t in self.lower]

    @property
    def key_prefix(self) -> str | None:
        """The first lower tier's that has one (a shared Redis store's)."""
        return next((t.key_prefix for t in self.lower if t.key_prefix is not None), None)

    def bind(self, promote: Callable[[Entry], Entry | None], to_lower: Callable[[Entry], Entry]) -> None:
        self._promote, self._to_lower = promote, to_lower

    def _put_in_memory(self, entry: Entry) -> Entry:
        self.memory.put(entry)
        return entry

    def _call(self, i: int, what: str, fn: Callable, *args):
        """``fn(*args)`` on lower tier i; None if it raised (counted and logged, never propagated)."""
        try:
            return fn(*args)
        except Exception as e:
            self._failures[i] += 1
            self._logs[i].failed(what, e)
            return None

    def _lower_get(self, fingerprint: int, token_ids: np.ndarray, namespace: str) -> tuple[int, Entry] | None:
        for i, tier in enumerate(self.lower):
            entry = self._call(i, "a lookup", tier.get, fingerprint, token_ids, namespace)
            if entry is not None:
                return i, entry
        return None

    def prefetch(self, wanted: list[tuple[int, np.ndarray, str]]) -> int:
        """Stage the lower tiers' entries for (fingerprint, token ids, namespace) triples the memory
        tier lacks; returns how many were found. Safe to call from any thread."""
        found = 0
        for fingerprint, token_ids, namespace in wanted:
            if fingerprint in self.memory or fingerprint in self._staged:
                continue
            hit = self._lower_get(fingerprint, token_ids, namespace)
            if hit is not None:
                with self._staged_lock:
                    self._staged[fingerprint] = hit
                    while len(self._staged) > self.max_staged:
                        self._staged.popitem(last=False)
                found += 1
        return found

    def _staged_entry(self, fingerprint: int, token_ids: np.ndarray, namespace: str) -> tuple[int, Entry] | None:
        with self._staged_lock:
            staged = self._staged.pop(fingerprint, None)
        if staged is not None and staged[1].matches(token_ids, namespace):
            return staged
        return None

    def get(self, fingerprint: int, token_ids: np.ndarray, namespace: str = "") -> Entry | None:
        entry = self.memory.get(fingerprint, token_ids, namespace)
        if entry is None:
            hit = self._staged_entry(fingerprint, token_ids, namespace) or self._lower_get(
                fingerprint, token_ids, namespace
            )
            if hit is not None:
                i, found = hit
                if i:
                    self._enqueue(found, range(i))  # NOTE: the tiers above it, off this thread
                entry = self._promote(found)
        self._hits += entry is not None
        self._misses += entry is None
        return entry

    def peek(self, fingerprint: int) -> Entry | None:
        return self.memory.peek(fingerprint)

    def put(self, entry: Entry) -> bool:
        stored = self.memory.put(entry)
        if self.lower:
            self._enqueue(self._to_lower(entry), range(len(self.lower)))
        return stored

    def write_lower(self, entry: Entry) -> None:
        """Write an entry that holds its rows (as the lower tiers keep them) to every lower tier, on the
        writer thread, not to memory: for a caller whose memory tier learns of a chunk before its rows
        exist (the vLLM connector). A full queue drops it, counted in `dropped_writes`."""
        self._enqueue(entry, range(len(self.lower)))

    def _enqueue(self, entry: Entry, tiers: range) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="irminsul-store-writer", daemon=True)
            self._writer.start()
        try:
            self._writes.put_nowait((entry, tiers))
        except queue.Full:
            self.dropped_writes += 1

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                entry, tiers = item
                for i in tiers:  # lower tiers keep the first copy that verifies (disk: skip, Redis: SET NX)
                    self._call(i, "a write", self.lower[i].put, entry)
            finally:
                self._writes.task_done()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued lower-tier writes are written (tests, shutdown); False on timeout."""
        end = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.01)
        return not self._writes.unfinished_tasks

    def evict(self, nbytes: int, spare=None) -> int:
        return self.memory.evict(nbytes, spare)

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
        collisions = m.collisions + sum(
            self._call(i, "its stats", lambda t=t: t.stats.collisions) or 0 for i, t in enumerate(self.lower)
        )
        return RegistryStats(
            self._hits,
            self._misses,
            collisions,
            m.evictions,
            m.insertions,
            m.rejected,
            m.entries,
            m.pinned,
            m.bytes,
            m.budget_bytes,
        )

    @property
    def all_tier_stats(self) -> list[TierStats]:
        return [memory_tier_stats(self.memory), *(self._lower_stats(i) for i in range(len(self.lower)))]

    def _lower_stats(self, i: int) -> TierStats:
        tier, failures = self.lower[i], self._failures[i]
        try:
            s = tier.tier_stats
            if s is None:
                s = memory_tier_stats(tier)
        except Exception:  # (/metrics still answers)
            return TierStats(self._logs[i].tier, 0, 0, 0, 0, 0, 0, 0, failures=failures, available=False)
        return dataclasses.replace(s, failures=s.failures + failures)

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writes.put(None)
        for i, tier in enumerate(self.lower):
            self._call(i, "flush", tier.flush)
            self._call(i, "close", tier.close)
