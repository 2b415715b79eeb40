"""A compact set of 64-bit chunk fingerprints: what a router knows one replica holds.

A Python set of ints costs about 60-90 bytes per member; a router following 64 replicas of a
million chunks each would hold gigabytes. Here the bulk is one sorted uint64 array (8 bytes a
member) and the changes since it was last rebuilt sit in two small Python sets, merged into the
array once they outgrow a share of it (a log-structured merge, in miniature). Lookups are one
`searchsorted` over the array for the whole prompt plus a set probe per chunk.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

MERGE_SHARE = 8  # rebuild the array once the overlays hold more than 1/8 of it ...
MERGE_MIN = 4096  # ... and at least this many changes: a small set is rebuilt rarely, not on every poll


class FingerprintSet:
    def __init__(self, fingerprints: ArrayLike = ()) -> None:
        self._base = np.unique(np.asarray(fingerprints, np.uint64))  # [n] sorted, unique
        self._added: set[int] = set()  # members not in _base
        self._removed: set[int] = set()  # entries of _base that are no longer members

    def replace(self, fingerprints: ArrayLike) -> None:
        """Start over from a whole resident set."""
        self._base = np.unique(np.asarray(fingerprints, np.uint64))
        self._added, self._removed = set(), set()

    def add(self, fingerprints: np.ndarray) -> None:
        fingerprints = np.asarray(fingerprints, np.uint64)
        in_base = self._in_base(fingerprints)
        self._removed.difference_update(fingerprints[in_base].tolist())
        self._added.update(fingerprints[~in_base].tolist())
        self._maybe_merge()

    def remove(self, fingerprints: np.ndarray) -> None:
        fingerprints = np.asarray(fingerprints, np.uint64)
        in_base = self._in_base(fingerprints)
        self._removed.update(fingerprints[in_base].tolist())
        self._added.difference_update(fingerprints[~in_base].tolist())
        self._maybe_merge()

    def contains(self, fingerprints: np.ndarray) -> np.ndarray:
        """[n] bool: which of the fingerprints are members."""
        fingerprints = np.asarray(fingerprints, np.uint64)
        found = self._in_base(fingerprints)
        if self._added or self._removed:
            listed = fingerprints.tolist()
            # (isdisjoint runs in C: most prompts touch no recent change, and skip the Python loop)
            if not self._added.isdisjoint(listed):
                found |= np.fromiter((f in self._added for f in listed), bool, len(listed))
            if not self._removed.isdisjoint(listed):
                found &= ~np.fromiter((f in self._removed for f in listed), bool, len(listed))
        return found

    def __contains__(self, fingerprint: int) -> bool:
        return bool(self.contains(np.array([fingerprint], np.uint64))[0])

    def __len__(self) -> int:
        return len(self._base) - len(self._removed) + len(self._added)

    def __iter__(self):
        return iter(self.to_array().tolist())

    def to_array(self) -> np.ndarray:
        """[n] uint64, sorted."""
        base = self._base
        if self._removed:
            base = base[~np.isin(base, np.fromiter(self._removed, np.uint64, len(self._removed)))]
        if self._added:
            base = np.union1d(base, np.fromiter(self._added, np.uint64, len(self._added)))
        return base

    @property
    def nbytes(self) -> int:
        """Roughly what the set holds in memory (the overlays at a Python set's ~72 bytes a member)."""
        return self._base.nbytes + 72 * (len(self._added) + len(self._removed))

    def _in_base(self, fingerprints: np.ndarray) -> np.ndarray:
        if not len(self._base):
            return np.zeros(len(fingerprints), bool)
        i = np.searchsorted(self._base, fingerprints)
        return self._base[np.minimum(i, len(self._base) - 1)] == fingerprints

    def _maybe_merge(self) -> None:
        if len(self._added) + len(self._removed) > max(MERGE_MIN, len(self._base) // MERGE_SHARE):
            self._base = self.to_array()
            self._added, self._removed = set(), set()
