"""Which chunks an engine's pool holds, as a journal a router can follow compactly.

Every chunk the memory tier of the registry stores or drops is logged in order with a sequence
number. A follower (a fleet router polling a replica) asks for the changes since the last number it
saw and gets the net additions and removals, 8 bytes per fingerprint; only a follower that fell
further behind than the journal keeps (or a new one) gets the whole resident set instead. So a
replica holding a million chunks ships its churn per poll, not its contents.

Thread-safe: the engine thread writes, a routing-stats poll reads.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class JournalDelta:
    seq: int  # the journal's number after these changes: ask `since(seq)` next
    added: np.ndarray  # [n] uint64 fingerprints now resident that were not at the asked number
    removed: np.ndarray  # [m] uint64 fingerprints resident then that are not now
    full: bool  # added is the whole resident set (the follower starts over)

    @property
    def nbytes(self) -> int:
        return self.added.nbytes + self.removed.nbytes


class ChunkJournal:
    def __init__(self, keep: int = 1 << 20):
        """`keep`: changes kept for followers; one further behind gets the whole set."""
        self._resident: dict[int, int] = {}  # fingerprint -> entries holding it (1, but counted)
        self._log: deque[tuple[int, int, bool]] = deque()  # (seq, fingerprint, added)
        self._keep = keep
        self._seq = 0
        self._floor = 0  # changes after this number are all in the log
        self._lock = threading.Lock()

    def added(self, fingerprint: int) -> None:
        with self._lock:
            n = self._resident.get(fingerprint, 0)
            self._resident[fingerprint] = n + 1
            if n == 0:
                self._record(fingerprint, True)

    def removed(self, fingerprint: int) -> None:
        with self._lock:
            n = self._resident.get(fingerprint, 0)
            if n <= 1:
                if self._resident.pop(fingerprint, None) is not None:
                    self._record(fingerprint, False)
            else:
                self._resident[fingerprint] = n - 1

    def _record(self, fingerprint: int, added: bool) -> None:
        self._seq += 1
        self._log.append((self._seq, fingerprint, added))
        while len(self._log) > self._keep:
            self._floor = self._log.popleft()[0]

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, fingerprint: int) -> bool:
        return fingerprint in self._resident

    @property
    def seq(self) -> int:
        return self._seq

    def since(self, seq: int | None) -> JournalDelta:
        """The net changes after number `seq` (None, or a number older than the journal keeps: the
        whole resident set, `full`)."""
        with self._lock:
            if seq is None or seq < self._floor or seq > self._seq:
                return JournalDelta(
                    self._seq, np.fromiter(self._resident, np.uint64, len(self._resident)), np.zeros(0, np.uint64), True
                )
            # changes alternate per fingerprint (only transitions are logged), so its first change
            # after `seq` says whether it was resident then: a removal means it was
            first: dict[int, bool] = {}
            for s, fingerprint, added in reversed(self._log):
                if s <= seq:
                    break
                first[fingerprint] = added  # (walking back: the earliest change after seq is left)
            came = [f for f, a in first.items() if a and f in self._resident]
            went = [f for f, a in first.items() if not a and f not in self._resident]
            return JournalDelta(self._seq, np.array(came, np.uint64), np.array(went, np.uint64), False)
