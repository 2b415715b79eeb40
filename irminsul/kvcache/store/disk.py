"""The disk tier: one safetensors file per entry under ``root/<model id>/<key id>/``, surviving restarts.

The index (fingerprint -> file size, in LRU order) lives in memory and is rebuilt on open from the
directory, oldest modification time first; a hit touches the file so that order survives restarts
too. Writes go to a temporary file and are renamed into place, so a crash never leaves a half
entry under a real name, and a write that fails (a full disk, a read-only remount) removes its
temporary file. Every read is verified (codec.decode) and its token ids and namespace compared; a
corrupt or mismatching entry is deleted, counted and reported as a miss, so the engine recomputes
it, and a write may replace a file that does not verify (first writer wins only among entries
that do).

Whoever can write the directory can put anything at an entry's name: only a regular file no longer
than the longest entry the tier writes (``RowLayout.max_blob_bytes``) is read (entry_file.py), and
anything else (a FIFO, a link, a device, a directory, a sparse giant) is a miss, dropped and counted
as corrupt, at a lookup or in the index scan at start. No file is opened, read, touched, renamed or
removed under the index's lock: a slow or hostile file delays the one lookup that reads it, never
another.

The disk may fail after start. A failed read, touch, write or delete is a miss or a skipped write,
counted in ``failures`` and logged at most once per interval; it never raises into the engine.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from irminsul.errors import UserFacingError
from irminsul.kvcache.registry import Entry, PinCounts, Registry, RegistryStats
from irminsul.kvcache.store.codec import CorruptEntry, RowLayout, decode, encode
from irminsul.kvcache.store.entry_file import NotAnEntry, read_entry, why_not
from irminsul.kvcache.store.stats import TierLog, TierStats

SUFFIX = ".safetensors"


class _Held(NamedTuple):
    size: int  # bytes on disk, charged against the budget
    stamp: int  # which load or write put it in the index: a reader forgets only the file it read


class DiskRegistry(Registry):
    log: TierLog  # (set in __init__: this tier's own, which the tiered registry shares)

    def __init__(self, root: str | Path, layout: RowLayout, budget_bytes: int):
        super().__init__()
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.layout, self.budget_bytes = layout, budget_bytes
        self.max_entry_bytes = layout.max_blob_bytes
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
        # NOTE: the lock guards the index and the counters only: no file I/O happens under it
        self._lock = threading.Lock()
        self._index: OrderedDict[int, _Held] = OrderedDict()  # fingerprint -> file, LRU first
        self._claimed: set[int] = set()  # in the index, their files still being renamed into place
        self._stamps = itertools.count()
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
        with self._lock:
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
                fp = int(f.name.removesuffix(SUFFIX), 16)
            except ValueError:
                continue
            if f.name != self._path(fp).name:  # not an entry's name: another file, left alone
                continue
            try:
                st = f.lstat()
            except OSError as e:
                self._failed(f"reading {f.name}", e)
                continue
            why = why_not(st, self.max_entry_bytes)
            if why is not None:
                self._bad(fp, why, None)
                continue
            files.append((st.st_mtime_ns, fp, st.st_size))
        for _, fp, size in sorted(files):
            self._index[fp] = _Held(size, next(self._stamps))
            self._bytes += size
        self._remove(self._evict(0))  # the budget may have shrunk since the last run

    def _read(self, fingerprint: int) -> tuple[Entry | None, _Held | None]:
        """The verified entry and the index record it was read under ((None, record) on a miss). A
        file that is not a verified entry is dropped and counted; one unreadable now is left."""
        with self._lock:
            held = None if fingerprint in self._claimed else self._index.get(fingerprint)
        if held is None:
            return None, None
        try:
            blob = read_entry(self._path(fingerprint), self.max_entry_bytes)
        except FileNotFoundError:  # removed behind our back (an operator, a cleaner): a miss, not corruption
            with self._lock:
                self._forget(fingerprint, held)
            return None, held
        except NotAnEntry as e:  # planted: a FIFO, a link, a directory, a giant
            self._bad(fingerprint, str(e), held)
            return None, held
        except OSError as e:  # unreadable now (permissions, I/O error): a miss; the file may be fine
            self._failed(f"reading entry {fingerprint:016x}", e)
            return None, held
        try:
            return decode(blob, self.layout, fingerprint), held
        except CorruptEntry as e:  # foreign ones too: at our path, no holder of our secret wrote them
            self._bad(fingerprint, str(e), held)
            return None, held

    def get(self, fingerprint: int, token_ids: np.ndarray, namespace: str = "") -> Entry | None:
        entry, held = self._read(fingerprint)
        hit = entry is not None and entry.matches(token_ids, namespace)
        with self._lock:
            if hit:
                self._hits += 1
                if fingerprint in self._index:
                    self._index.move_to_end(fingerprint)
            else:
                self._misses += 1
                self._collisions += entry is not None
        if not hit:
            if entry is not None and entry.namespace == namespace:  # another chunk of ours: dropped, the
                self._drop(fingerprint, held)  # caller recomputes (another namespace's entry is left to its owner)
            return None
        try:
            os.utime(self._path(fingerprint), follow_symlinks=False)
        except OSError as e:  # a read-only disk still serves what it holds
            self._failed(f"touching entry {fingerprint:016x}", e)
        return entry

    def peek(self, fingerprint: int) -> Entry | None:
        return self._read(fingerprint)[0]

    def put(self, entry: Entry) -> bool:
        """Write an entry; a fingerprint already held by an entry that verifies is kept (first writer
        wins, like Redis SET NX), one held by a file that does not is replaced. False if it was not
        written (over the budget, longer than any entry, or the write failed)."""
        fp = entry.fingerprint
        found, held = self._read(fp)
        if found is not None:
            return True
        with self._lock:
            now = self._index.get(fp)
            if now is not None and now == held:  # unreadable now, not known bad: neither served nor replaced
                self._dropped += 1
                return False
            if now is not None:  # another writer's copy, written or being written, is kept
                return True
        blob = encode(entry, self.layout)
        with self._lock:
            if len(blob) > self.max_entry_bytes or not self._fits(fp, len(blob)):
                self._rejected += 1
                return False
        tmp = self.dir / f"{fp:016x}.{os.getpid()}.{threading.get_ident()}.tmp"
        claimed, placed = None, False
        try:
            tmp.write_bytes(blob)
            with self._lock:
                if fp in self._index:  # another thread wrote it meanwhile: theirs is kept
                    return True
                if not self._fits(fp, len(blob)):
                    self._rejected += 1
                    return False
                victims = self._evict(len(blob))
                claimed = self._index[fp] = _Held(len(blob), next(self._stamps))
                self._claimed.add(fp)
                self._bytes += len(blob)
            self._remove(victims)
            os.replace(tmp, self._path(fp))
            placed = True
            with self._lock:
                self._claimed.discard(fp)
                self._insertions += 1
            return True
        except OSError as e:  # a full or read-only disk: the write is skipped
            if claimed is not None:
                with self._lock:
                    self._claimed.discard(fp)
                    self._forget(fp, claimed)
            self._failed(f"writing entry {fp:016x}", e)
            with self._lock:
                self._dropped += 1
            return False
        finally:
            if not placed:
                self._unlink(tmp)  # NOTE: a failed write must not leave its bytes behind to fill the disk

    # -- the index (each of these runs under the lock) -----------------------------------

    def _fits(self, fingerprint: int, size: int) -> bool:
        kept = {*self._pins, *self._claimed} - {fingerprint}  # (no eviction makes room there)
        return sum(self._index[fp].size for fp in kept if fp in self._index) + size <= self.budget_bytes

    def _evict(self, need: int) -> list[Path]:
        """Take least recently used entries out of the index until `need` more bytes fit; their files,
        for the caller to remove once it has let go of the lock."""
        victims = []
        while self._bytes + need > self.budget_bytes:
            victim = next((fp for fp in self._index if fp not in self._pins and fp not in self._claimed), None)
            if victim is None:
                break
            self._bytes -= self._index.pop(victim).size
            self._evictions += 1
            victims.append(self._path(victim))
        return victims

    def _forget(self, fingerprint: int, held: _Held) -> bool:
        """Take the file `held` names out of the index, if the index still holds that one there."""
        if self._index.get(fingerprint) != held:
            return False
        del self._index[fingerprint]
        self._bytes -= held.size
        return True

    # -- files (never under the lock) ----------------------------------------------------

    def _bad(self, fingerprint: int, reason: str, held: _Held | None) -> None:
        """A file at an entry's name that is not a verified entry of ours: counted, logged, dropped."""
        with self._lock:
            self._corrupt += 1
        self.log.corrupt(fingerprint, reason)
        self._drop(fingerprint, held)

    def _drop(self, fingerprint: int, held: _Held | None) -> None:
        """Forget the file a reader found (`held`; None: one the index never took) and remove it."""
        with self._lock:
            gone = held is None or self._forget(fingerprint, held)
        if gone:
            # NOTE: a writer may put a new file here between the two steps; removing it costs one miss
            self._unlink(self._path(fingerprint))

    def _remove(self, paths: list[Path]) -> None:
        for path in paths:
            self._unlink(path)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except IsADirectoryError:  # planted where an entry belongs: left there, out of the index
            pass
        except OSError as e:  # a read-only disk: the file stays, out of the index
            self._failed(f"removing {path.name}", e)

    def pin(self, fingerprint: int) -> None:
        with self._lock:
            self._pins.add(fingerprint)

    def unpin(self, fingerprint: int) -> None:
        with self._lock:
            self._pins.remove(fingerprint)

    def __contains__(self, fingerprint: int) -> bool:
        return fingerprint in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def stats(self) -> RegistryStats:
        return RegistryStats(
            self._hits,
            self._misses,
            self._collisions,
            self._evictions,
            self._insertions,
            self._rejected,
            len(self._index),
            len(self._pins),
            self._bytes,
            self.budget_bytes,
        )

    @property
    def tier_stats(self) -> TierStats:
        s = self.stats
        return TierStats(
            "disk",
            s.hits,
            s.misses,
            s.evictions,
            s.insertions,
            s.entries,
            s.bytes,
            s.budget_bytes,
            corrupt=self._corrupt,
            failures=self._failures,
            dropped=self._dropped,
        )
