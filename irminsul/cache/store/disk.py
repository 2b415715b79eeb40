"""The disk tier: one safetensors file per entry under ``root/<model id>/``, surviving restarts.

The index (fingerprint -> file size, in LRU order) lives in memory and is rebuilt on open from the
directory, oldest modification time first; a hit touches the file so that order survives restarts
too. Writes go to a temporary file and are renamed into place, so a crash never leaves a half
entry under a real name. Every read is verified (codec.decode) and its token ids compared; a corrupt or mismatching entry
is deleted, counted and reported as a miss, so the engine recomputes it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from irminsul.cache.registry import Entry, PinCounts, Registry, RegistryStats
from irminsul.cache.store.codec import CorruptEntry, ForeignEntry, RowLayout, decode, encode
from irminsul.cache.store.stats import CorruptionLog, TierStats
from irminsul.errors import UserFacingError

SUFFIX = ".safetensors"


class DiskRegistry(Registry):
    def __init__(self, root: str | Path, layout: RowLayout, budget_bytes: int):
        super().__init__()
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.layout, self.budget_bytes = layout, budget_bytes
        self.dir = Path(root) / layout.model_id
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".irminsul-write-check"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise UserFacingError(f"--store disk:{root}: cannot use {self.dir} as a store ({e.strerror})") from None
        self._lock = threading.Lock()  # NOTE: the scheduler reads while a tiered writer may put
        self._index: OrderedDict[int, int] = OrderedDict()  # fingerprint -> file bytes, LRU first
        self._pins = PinCounts()
        self._bytes = 0
        self._hits = self._misses = self._collisions = self._corrupt = 0
        self._evictions = self._insertions = self._rejected = 0
        self._report = CorruptionLog("disk")
        self._load_index()

    def _path(self, fingerprint: int) -> Path:
        return self.dir / f"{fingerprint:016x}{SUFFIX}"

    def _load_index(self) -> None:
        files = []
        for f in self.dir.iterdir():
            if f.name.endswith(".tmp"):
                f.unlink(missing_ok=True)  # a write that never finished
                continue
            try:
                fp, st = int(f.name.removesuffix(SUFFIX), 16), f.stat()
            except (ValueError, OSError):
                continue
            files.append((st.st_mtime_ns, fp, st.st_size))
        for _, fp, size in sorted(files):
            self._index[fp] = size
            self._bytes += size
        self._evict(0)  # the budget may have shrunk since the last run

    def _read(self, fingerprint: int) -> Entry | None:
        """The verified entry, or None (a corrupt file is dropped and counted)."""
        try:
            blob = self._path(fingerprint).read_bytes()
            return decode(blob, self.layout, fingerprint)
        except ForeignEntry:
            return None  # another namespace's (another store secret): not ours to serve or drop
        except FileNotFoundError:  # removed behind our back (an operator, a cleaner): a miss, not corruption
            self._drop(fingerprint)
            return None
        except (OSError, CorruptEntry) as e:
            self._corrupt += 1
            self._report(fingerprint, str(e))
            self._drop(fingerprint)
            return None

    def get(self, fingerprint: int, token_ids: np.ndarray) -> Entry | None:
        with self._lock:
            entry = self._read(fingerprint) if fingerprint in self._index else None
            if entry is None or not np.array_equal(entry.token_ids, token_ids):
                self._misses += 1
                if entry is not None:  # a mismatching entry is dropped; the caller recomputes
                    self._collisions += 1
                    self._drop(fingerprint)
                return None
            self._index.move_to_end(fingerprint)
            os.utime(self._path(fingerprint))
            self._hits += 1
            return entry

    def peek(self, fingerprint: int) -> Entry | None:
        with self._lock:
            return self._read(fingerprint) if fingerprint in self._index else None

    def put(self, entry: Entry) -> bool:
        """Write an entry; a fingerprint already on disk is kept (first writer wins, like Redis SET NX)."""
        if entry.fingerprint in self._index:
            return True
        blob = encode(entry, self.layout)
        with self._lock:
            pinned = sum(self._index[fp] for fp in self._pins if fp != entry.fingerprint and fp in self._index)
            if pinned + len(blob) > self.budget_bytes:
                self._rejected += 1
                return False
            self._evict(len(blob))
            tmp = self.dir / f"{entry.fingerprint:016x}.{threading.get_ident()}.tmp"
            tmp.write_bytes(blob)
            os.replace(tmp, self._path(entry.fingerprint))
            self._index[entry.fingerprint] = len(blob)
            self._bytes += len(blob)
            self._insertions += 1
            return True

    def _evict(self, need: int) -> None:
        while self._bytes + need > self.budget_bytes:
            victim = next((fp for fp in self._index if fp not in self._pins), None)
            if victim is None:
                return
            self._drop(victim)
            self._evictions += 1

    def _drop(self, fingerprint: int) -> None:
        size = self._index.pop(fingerprint, None)
        if size is not None:
            self._bytes -= size
            self._path(fingerprint).unlink(missing_ok=True)

    def pin(self, fingerprint: int) -> None:
        self._pins.add(fingerprint)

    def unpin(self, fingerprint: int) -> None:
        self._pins.remove(fingerprint)

    def __contains__(self, fingerprint: int) -> bool:
        return fingerprint in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def stats(self) -> RegistryStats:
        return RegistryStats(self._hits, self._misses, self._collisions, self._evictions, self._insertions,
                             self._rejected, len(self._index), len(self._pins), self._bytes, self.budget_bytes)

    @property
    def tier_stats(self) -> TierStats:
        s = self.stats
        return TierStats("disk", s.hits, s.misses, s.evictions, s.insertions, s.entries, s.bytes,
                         s.budget_bytes, corrupt=self._corrupt)
