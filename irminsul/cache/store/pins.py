"""Reference counts of pinned fingerprints (a pinned entry is in use and must not be evicted)."""

from __future__ import annotations


class PinCounts:
    def __init__(self):
        self._counts: dict[int, int] = {}

    def add(self, fingerprint: int) -> None:
        self._counts[fingerprint] = self._counts.get(fingerprint, 0) + 1

    def remove(self, fingerprint: int) -> None:
        count = self._counts.get(fingerprint, 0)
        if count == 0:
            raise KeyError(f"cannot unpin fingerprint {fingerprint:#x}: it is not pinned")
        if count == 1:
            del self._counts[fingerprint]
        else:
            self._counts[fingerprint] = count - 1

    def __contains__(self, fingerprint: int) -> bool:
        return fingerprint in self._counts

    def __iter__(self):
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)
