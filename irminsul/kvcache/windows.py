"""Index of fixed 128-token windows inside registered chunks, for S1 "detect and recover".

Design doc section 3 step 6: when a CDC chunk misses because its boundaries drifted, stored
windows inside it are looked for at *any* offset. Each registered entry contributes its
non-overlapping windows at offsets 0, W, 2W, ... (fully inside the entry). A query computes a
rolling hash at every offset of its span, vectorised; the caller confirms candidates by token
comparison, so a hash collision only costs a comparison.

Hash of the window starting at ``s``: ``H(s) = sum_{j<W} x[s+j] * B^j (mod 2^64)`` with
``x = G[t]`` (the chunker's Gear values, for mixing) and odd ``B``. With prefix sums
``P[i] = sum_{k<i} x[k] * B^k``, ``H(s) = (P[s+W] - P[s]) * B^-s``: ``B`` is odd, so its
inverse mod 2^64 exists and every offset costs O(1) vectorised uint64 operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from irminsul.kvcache.chunker import TokenArray, as_tokens, gear

_BASE = 0x9E3779B97F4A7C15  # odd
_BASE_INV = pow(_BASE, -1, 1 << 64)


@dataclass(frozen=True)
class WindowHit:
    query_pos: int  # window start in the query sequence
    fingerprint: int  # registry entry holding the same hash
    entry_offset: int  # window start inside that entry's token_ids


def _powers(base: int, n: int) -> np.ndarray:
    """[n] uint64: base^0 .. base^(n-1) mod 2^64."""
    out = np.full(n, base, dtype=np.uint64)
    if n:
        out[0] = 1
    return np.multiply.accumulate(out)  # integer overflow wraps: exactly mod 2^64


class WindowIndex:
    """Window hash -> [(fingerprint, entry offset)] for the live entries of a registry."""

    def __init__(self, window: int = 128):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._by_hash: dict[int, list[tuple[int, int]]] = {}
        self._by_fp: dict[int, list[int]] = {}  # fingerprint -> its window hashes (for remove)
        self._pow = self._inv_pow = np.ones(0, np.uint64)

    def rolling_hashes(self, tokens: TokenArray) -> np.ndarray:
        """[n - W + 1] uint64: H(s) for every window start s (empty when n < W)."""
        x = gear(tokens)  # [n]
        n, w = len(x), self.window
        if n < w:
            return np.zeros(0, np.uint64)
        self._grow(n + 1)
        prefix = np.zeros(n + 1, np.uint64)  # P[i] = sum_{k<i} x[k] B^k
        np.cumsum(x * self._pow[:n], out=prefix[1:])
        return (prefix[w:] - prefix[: n - w + 1]) * self._inv_pow[: n - w + 1]

    def add(self, fingerprint: int, token_ids: TokenArray) -> None:
        """Index the windows at offsets 0, W, 2W, ... of an entry (replacing earlier ones)."""
        self.remove(fingerprint)
        hashes = self.rolling_hashes(token_ids)[:: self.window].tolist()
        for i, h in enumerate(hashes):
            self._by_hash.setdefault(h, []).append((fingerprint, i * self.window))
        self._by_fp[fingerprint] = hashes

    def remove(self, fingerprint: int) -> None:
        """Drop an entry's windows; a no-op for unknown fingerprints."""
        for h in dict.fromkeys(self._by_fp.pop(fingerprint, ())):  # an entry may repeat a window
            kept = [item for item in self._by_hash[h] if item[0] != fingerprint]
            if kept:
                self._by_hash[h] = kept
            else:
                del self._by_hash[h]

    def candidates(self, tokens: TokenArray, start: int, end: int) -> list[WindowHit]:
        """Unconfirmed hits for every window fully inside ``tokens[start:end]``, by query_pos."""
        ids = as_tokens(tokens)
        hashes = self.rolling_hashes(ids[start:end]).tolist()
        return [
            WindowHit(start + s, fp, off)
            for s, h in enumerate(hashes)
            if h in self._by_hash
            for fp, off in self._by_hash[h]
        ]

    def __len__(self) -> int:
        """Number of indexed windows."""
        return sum(len(v) for v in self._by_fp.values())

    def _grow(self, n: int) -> None:
        if len(self._pow) < n:
            size = max(n, 2 * len(self._pow))
            self._pow, self._inv_pow = _powers(_BASE, size), _powers(_BASE_INV, size)
