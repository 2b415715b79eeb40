"""Content-defined chunking (CDC) of token ids with a Gear rolling hash.

Irminsul paper (Ma et al., arXiv 2605.05696) section 3, step 2; the Gear hash is FastCDC's
(Xia et al., USENIX ATC '16): a 64-bit state ``h = (h << 1) + G[t] (mod 2^64)`` and a boundary
after token ``i`` when ``h & (2^mask_bits - 1) == 0``, so chunks average ``2^mask_bits`` tokens
beyond ``min_len``. Lengths are clamped to ``[min_len, max_len]``.

NOTE (honest window): because of the shift, the full 64-bit state depends on the last 64
tokens, but the *boundary test* reads only the low ``mask_bits`` bits, and a token's ``G``
value has left those bits after ``mask_bits`` shifts. The effective window of the test is
therefore ``mask_bits`` tokens (7 by default), not 64. That is what makes the test exactly
vectorisable: ``h_i & mask == (sum_{k<mask_bits} G[t_{i-k}] << k) & mask``. Content re-
synchronises after ``mask_bits`` tokens; the tests run the literal recurrence as a slow reference
(tests/kvcache/oracles.py) and check bit-exact agreement.

``G`` is ``splitmix64(GEAR_SEED ^ id)``: the same on every process and machine, defined for any
token id below 2^32, with no vocabulary table.

S2 (paper section 3, "prevent by cooperation"): the hash state resets and a cut is forced at every
segment start, either given by the caller or found after each occurrence of a boundary marker.

Fingerprints are xxHash64 of the chunk's ids as little-endian uint32, seeded by the namespace
(model identity + tenant, docs/design.md section 6).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

GEAR_SEED = 0x1F83D9ABFB41BD6B  # fixed forever: changing it changes every fingerprint boundary

TokenArray = Sequence[int] | np.ndarray
FingerprintFn = Callable[[np.ndarray, int], int]  # (token ids, seed) -> 64-bit fingerprint


@dataclass(frozen=True)
class ChunkerConfig:
    min_len: int = 32
    max_len: int = 512
    mask_bits: int = 7
    marker: tuple[int, ...] | None = None  # S2 boundary marker; a segment starts right after it

    def __post_init__(self):
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if not 1 <= self.mask_bits <= 32:
            raise ValueError(f"mask_bits must be in [1, 32], got {self.mask_bits}")
        if self.marker is not None:
            if len(self.marker) == 0 or any(not 0 <= t < 2**32 for t in self.marker):
                raise ValueError("marker must be a non-empty tuple of token ids in [0, 2^32)")
            object.__setattr__(self, "marker", tuple(int(t) for t in self.marker))

    @property
    def mask(self) -> int:
        return (1 << self.mask_bits) - 1


@dataclass(frozen=True)
class Chunk:
    start: int  # token positions [start, end) in the sequence that was chunked
    end: int
    fingerprint: int

    def __len__(self) -> int:
        return self.end - self.start


def as_tokens(tokens: TokenArray) -> np.ndarray:
    """Token ids as a 1-D int64 array (no copy when already one)."""
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    return arr


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Vigna's splitmix64 finaliser, element-wise on uint64 (wrap-around arithmetic)."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    tmp = np.empty_like(z)
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        np.right_shift(z, np.uint64(shift), out=tmp)
        np.bitwise_xor(z, tmp, out=z)
        np.multiply(z, np.uint64(mult), out=z)
    np.right_shift(z, np.uint64(31), out=tmp)
    np.bitwise_xor(z, tmp, out=z)
    return z


def _check_range(ids: np.ndarray) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2^32)")


def gear(tokens: TokenArray) -> np.ndarray:
    """G[t] for every token: uint64, ``splitmix64(GEAR_SEED ^ t)``."""
    ids = as_tokens(tokens)
    _check_range(ids)
    return splitmix64(ids.astype(np.uint64) ^ np.uint64(GEAR_SEED))


def segment_starts_of(tokens: np.ndarray, cfg: ChunkerConfig, segment_starts: TokenArray | None = None) -> np.ndarray:
    """Sorted unique segment starts in (0, n): the caller's plus one after every marker."""
    n = len(tokens)
    starts = np.zeros(0, np.int64)
    if segment_starts is not None:
        starts = as_tokens(segment_starts)
        if starts.size and (starts.min() < 0 or starts.max() > n):
            raise ValueError(f"segment starts must lie in [0, {n}]")
    if cfg.marker is not None:
        starts = np.concatenate([starts, marker_ends(tokens, cfg.marker)])
    starts = np.unique(starts)
    return starts[(starts > 0) & (starts < n)]


def marker_ends(tokens: np.ndarray, marker: tuple[int, ...]) -> np.ndarray:
    """Position right after every (possibly overlapping) occurrence of ``marker``."""
    m = len(marker)
    hits = np.flatnonzero(tokens[: max(len(tokens) - m + 1, 0)] == marker[0])
    for j in range(1, m):  # narrow the candidate set one marker token at a time
        hits = hits[tokens[hits + j] == marker[j]]
    return hits + m


def candidates(tokens: TokenArray, cfg: ChunkerConfig, segment_starts: TokenArray | None = None) -> np.ndarray:
    """Raw Gear cut positions ``i + 1`` where ``h_i & mask == 0`` (before clamping)."""
    ids = as_tokens(tokens)
    return _candidates(ids, cfg, segment_starts_of(ids, cfg, segment_starts))


def _candidates(ids: np.ndarray, cfg: ChunkerConfig, starts: np.ndarray) -> np.ndarray:
    """``candidates`` for normalised segment starts (see ``segment_starts_of``)."""
    n = len(ids)
    if n == 0:
        return np.zeros(0, np.int64)
    # Only the low mask_bits bits matter, so do the shifted adds in the smallest dtype holding them.
    dtype = np.uint8 if cfg.mask_bits <= 8 else np.uint16 if cfg.mask_bits <= 16 else np.uint32
    g: np.ndarray = gear(ids).astype(dtype)  # [n]
    h = g.copy()
    if starts.size:  # tokens since the last segment start (the state resets there)
        pos = np.arange(n)
        since = pos - np.concatenate([[0], starts])[np.searchsorted(starts, pos, "right")]
    for k in range(1, min(cfg.mask_bits, n)):
        term = g[:-k] << dtype(k)
        if starts.size:
            term[since[k:] < k] = 0
        h[k:] += term
    return np.flatnonzero((h & dtype(cfg.mask)) == 0) + 1


def clamp(cands: np.ndarray, n: int, starts: np.ndarray, cfg: ChunkerConfig) -> np.ndarray:
    """Greedy left-to-right cuts: the first candidate giving a chunk >= min_len, else max_len.

    Segment starts and ``n`` are forced cuts; the last chunk of a segment may be short.
    One Python step per chunk (``np.searchsorted``), not per token.
    """
    cuts = []
    for seg_start, seg_end in zip(np.concatenate([[0], starts]).tolist(), np.concatenate([starts, [n]]).tolist()):
        pos = seg_start
        while pos < seg_end:
            limit = min(pos + cfg.max_len, seg_end)
            idx = np.searchsorted(cands, pos + cfg.min_len)
            pos = int(cands[idx]) if idx < len(cands) and cands[idx] < limit else limit
            cuts.append(pos)
    return np.asarray(cuts, np.int64)


def boundaries(tokens: TokenArray, cfg: ChunkerConfig, segment_starts: TokenArray | None = None) -> np.ndarray:
    """Chunk end positions after clamping: strictly increasing, last one is ``len(tokens)``."""
    ids = as_tokens(tokens)
    starts = segment_starts_of(ids, cfg, segment_starts)
    return clamp(_candidates(ids, cfg, starts), len(ids), starts, cfg)


def _le_u32(ids: np.ndarray) -> bytes:
    _check_range(ids)
    return np.ascontiguousarray(ids, dtype="<u4").tobytes()


def fingerprint(token_ids: TokenArray, seed: int) -> int:
    """xxHash64 of the ids as little-endian uint32 bytes, seeded by the namespace."""
    return xxhash.xxh64_intdigest(_le_u32(as_tokens(token_ids)), seed)


def namespace_seed(model_id: str, tenant: str = "") -> int:
    """64-bit seed for one cache namespace; the encoding is length-prefixed, so unambiguous."""
    parts = [model_id.encode(), tenant.encode()]
    data = b"".join(struct.pack("<Q", len(p)) + p for p in parts)
    return xxhash.xxh64_intdigest(data, 0)


def chunk(
    tokens: TokenArray,
    cfg: ChunkerConfig,
    seed: int,
    segment_starts: TokenArray | None = None,
    fingerprint_fn: FingerprintFn | None = None,
) -> list[Chunk]:
    """Cut ``tokens`` into content-defined chunks and fingerprint each one.

    ``fingerprint_fn(token_ids, seed)`` replaces xxHash64 (tests inject colliding hashes).
    """
    ids = as_tokens(tokens)
    ends = boundaries(ids, cfg, segment_starts).tolist()
    starts = [0] + ends[:-1]
    if fingerprint_fn is None:
        buf = memoryview(_le_u32(ids))  # 4 bytes per token, sliced per chunk without copies
        fps = [xxhash.xxh64_intdigest(buf[4 * s : 4 * e], seed) for s, e in zip(starts, ends)]
    else:
        fps = [fingerprint_fn(ids[s:e], seed) for s, e in zip(starts, ends)]
    return [Chunk(s, e, f) for s, e, f in zip(starts, ends, fps)]
