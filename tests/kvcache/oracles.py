"""Slow references for the chunker (`irminsul/kvcache/chunker.py`): the literal per-token loops
its vectorised code must agree with bit for bit. Tests only (and the chunker benchmark's baseline)."""

from __future__ import annotations

import numpy as np

from irminsul.kvcache.chunker import ChunkerConfig, TokenArray, as_tokens, gear, segment_starts_of

_MASK64 = (1 << 64) - 1


def reference_candidates(
    tokens: TokenArray, cfg: ChunkerConfig, segment_starts: TokenArray | None = None
) -> np.ndarray:
    """Slow reference: the literal 64-bit recurrence, one Python step per token."""
    ids = as_tokens(tokens)
    g = gear(ids)
    resets = set(segment_starts_of(ids, cfg, segment_starts).tolist())
    h, out = 0, []
    for i in range(len(ids)):
        if i in resets:
            h = 0
        h = ((h << 1) + int(g[i])) & _MASK64
        if h & cfg.mask == 0:
            out.append(i + 1)
    return np.asarray(out, np.int64)


def reference_clamp(cands: np.ndarray, n: int, starts: np.ndarray, cfg: ChunkerConfig) -> np.ndarray:
    """Slow reference for ``clamp``: walk token by token."""
    cand_set, forced = set(cands.tolist()), set(starts.tolist()) | {n}
    cuts, last = [], 0
    for p in range(1, n + 1):
        length = p - last
        if p in forced or length == cfg.max_len or (p in cand_set and length >= cfg.min_len):
            cuts.append(p)
            last = p
    return np.asarray(cuts, np.int64)
