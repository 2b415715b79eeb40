"""The disk tier: one safetensors file per entry under ``root/<model id>/<key id>/``, surviving restarts.

The index (fingerprint -> file size, in LRU order) lives in memory and is rebuilt on open from the
directory, oldest modification time first; a hit touches the file so that order survives restarts
too. Writes go to a temporary file and are renamed into place, so a crash never leaves a half
entry under a real name, and a write that fails (a full disk, a read-only remount) removes its
temporary file. Every read is verified (codec.decode) and its token ids and namespace compared; a
corrupt or mismatching entry is deleted, counted and reported as a miss, so the engine recomputes
it, and a write may replace a file that does not verify (first writer wins only among entries
that do).

The disk may fail after start. A failed read, touch, write or delete is a miss or a skipped write,
counted in ``failures`` and logged at most once per interval; it never raises into the engine.
A file being written holds no lock, so a slow disk delays that write, never a lookup.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from irminsul.cache.registry import Entry, PinCounts, Registry, RegistryStats
from irminsul.cache.store.codec import CorruptEntry, RowLayout, decode, encode
from irminsul.cache.store.stats import TierLog, TierStats
from irminsul.errors import UserFacingError

SUFFIX = ".safetensors"


class DiskRegistry(Registry):
    def __init__(self, root: str | Path, layout: RowLayout, budget_bytes: int):
        super().__init__()
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.layout, self.budget_bytes = layout, budget_bytes
        # NOTE: one directory per store secret: an entry under another secret is never at our path,
        # so whatever at our path fails verification was not written by a holder of our secret.
        self.dir = Path(root) / layout.model_id / layout.key_id
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
        self._failures = self._dropped = 0
        self.log = TierLog("disk")
        self._load_index()

    def _path(self, fingerprint: int) -> Path:
        return self.dir / f"{fingerprint:016x}{SUFFIX}"

    def _failed(self, what: str, error: OSError) -> None:
        self._failures += 1
        self.log.failed(what, error)

    def _load_index(self) -> None:
        try:
            names = list(self.dir.iterdir())
        except OSError as e:
            self._failed("listing the store", e)
            return
        files = []
        for f in names:
            if f.name.endswith(".tmp"):
                self._unlink(f)  # a write that never finished
                continue
            try:
                fp, st = int(f.name.removesuffix(SUFFIX), 16), f.stat()
            except ValueError:
                continue
            except OSError as e:
                self._failed(f"reading {f.name}", e)
                continue
            files.append((st.st_mtime_ns, fp, st.st_size))
        for _, fp, size in sorted(files):
            self._index[fp] = size
            self._bytes += size
        self._evict(0)  # the budget may have shrunk since the last run

    def _read(self, fingerprint: int) -> Entry | None:
        """The verified entry, or None (a file that does not verify is dropped and counted)."""
        try:
            blob = self._path(fingerprint).read_bytes()
        except FileNotFoundError:  # removed behind our back (an operator, a cleaner): a miss, not corruption
            self._forget(fingerprint)
            return None
        except OSError as e:  # unreadable now (permissions, I/O error): a miss; the file may be fine
            self._failed(f"reading entry {fingerprint:016x}", e)
            return None
        try:
            return decode(blob, self.layout, fingerprint)
        except CorruptEntry as e:  # foreign ones too: at our path, no holder of our secret wrote them
            self._corrupt += 1
            self.log.corrupt(fingerprint, str(e))
            self._drop(fingerprint)
            return None

    def get(self, fingerprint: int, token_ids: np.ndarray, namespace: str = "") -> Entry | None:
        with self._lock:
            entry = self._read(fingerprint) if fingerprint in self._index else None
            if entry is None or not entry.matches(token_ids, namespace):
                self._misses += 1
                if entry is not None:
                    self._collisions += 1
                    if entry.namespace == namespace:  # another chunk of ours: dropped, the caller recomputes
                        self._drop(fingerprint)  # (another namespace's entry is left to its owner)
                return None
            self._index.move_to_end(fingerprint)
            try:
                os.utime(self._path(fingerprint))
            except OSError as e:  # a read-only disk still serves what it holds
                self._failed(f"touching entry {fingerprint:016x}", e)
            self._hits += 1
            return entry

    def peek(self, fingerprint: int) -> Entry | None:
        with self._lock:
            return self._read(fingerprint) if fingerprint in self._index else None

    def put(self, entry: Entry) -> bool:
        """Write an entry; a fingerprint already held by an entry that verifies is kept (first writer
        wins, like Redis SET NX), one held by a file that does not is replaced. False if it was not
        written (over the budget, or the write failed)."""
        fp = entry.fingerprint
        with self._lock:
            if fp in self._index:
                if self._read(fp) is not None:
                    return True
                if fp in self._index:  # unreadable now, not known bad: neither served nor replaced
                    self._dropped += 1
                    return False
        blob = encode(entry, self.layout)
        with self._lock:
            if not self._fits(fp, len(blob)):
                self._rejected += 1
                return False
        tmp = self.dir / f"{fp:016x}.{os.getpid()}.{threading.get_ident()}.tmp"
        done = False
        try:
            tmp.write_bytes(blob)  # outside the lock: a slow disk delays this write, not lookups
            with self._lock:
                if fp in self._index:  # another thread wrote it meanwhile: theirs is kept
                    return True
                if not self._fits(fp, len(blob)):
                    self._rejected += 1
                    return False
                self._evict(len(blob))
                os.replace(tmp, self._path(fp))
                done = True
                self._index[fp] = len(blob)
                self._bytes += len(blob)
                self._insertions += 1
                return True
        except OSError as e:  # a full or read-only disk: the write is skipped
            self._failed(f"writing entry {fp:016x}", e)
            self._dropped += 1
            return False
        finally:
            if not done:
                self._unlink(tmp)  # NOTE: a failed write must not leave its bytes behind to fill the disk

    def _fits(self, fingerprint: int, size: int) -> bool:
        pinned = sum(self._index[fp] for fp in self._pins if fp != fingerprint and fp in self._index)
        return pinned + size <= self.budget_bytes

    def _evict(self, need: int) -> None:
        while self._bytes + need > self.budget_bytes:
            victim = next((fp for fp in self._index if fp not in self._pins), None)
            if victim is None:
                return
            self._drop(victim)
            self._evictions += 1

    def _forget(self, fingerprint: int) -> None:
        size = self._index.pop(fingerprint, None)
        if size is not None:
            self._bytes -= size

    def _drop(self, fingerprint: int) -> None:
        if fingerprint in self._index:
            self._forget(fingerprint)
            self._unlink(self._path(fingerprint))

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:  # a read-only disk: the file stays, out of the index
            self._failed(f"removing {path.name}", e)

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
                         s.budget_bytes, corrupt=self._corrupt, failures=self._failures, dropped=self._dropped)
