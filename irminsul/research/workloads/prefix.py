"""The exact longest common prefix of a sequence with every sequence seen before.

This is what an unbounded prefix cache (SGLang RadixAttention, vLLM APC without eviction) reuses.
The census and the fixed-block baseline use it as an independent reference, so they never depend
on the cache under test. Full 64-token blocks are chained by hash (as vLLM names its blocks); under
each chain the distinct next blocks are kept sorted, so the last partial block is compared exactly
against its two sorted neighbours.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np
import xxhash

from irminsul.kvcache.radix import common_prefix

ROOT = 0


def _common(a: bytes, b: bytes) -> int:
    """Tokens (4-byte ids) two byte strings share at the start."""
    return common_prefix(np.frombuffer(a, dtype=np.int32), np.frombuffer(b, dtype=np.int32))


class PrefixIndex:
    def __init__(self, block: int = 64):
        assert block > 0
        self.block = block
        # chain hash of k full blocks -> the distinct next blocks, sorted: the longest common
        # prefix with a set of byte strings is attained at a sorted neighbour of the query
        self._next: dict[int, list[bytes]] = {}

    def _chain(self, h: int, block: bytes) -> int:
        return xxhash.xxh3_128_intdigest(h.to_bytes(16, "little") + block)

    def match(self, tokens: np.ndarray) -> int:
        """Length of the longest common prefix with any inserted sequence."""
        return self._walk(tokens, insert=False)

    def add(self, tokens: np.ndarray) -> int:
        """`match`, then insert `tokens`."""
        return self._walk(tokens, insert=True)

    def _walk(self, tokens: np.ndarray, insert: bool) -> int:
        data = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
        step = 4 * self.block
        h, matched = ROOT, None
        for off in range(0, len(data), step):
            blk = data[off : off + step]
            nxt = self._next.get(h)
            i = bisect_left(nxt, blk) if nxt else 0
            present = nxt is not None and i < len(nxt) and nxt[i] == blk
            if matched is None and not (present and len(blk) == step):
                near = nxt[max(0, i - 1) : i + 1] if nxt else []
                matched = off // 4 + max((_common(blk, c) for c in near), default=0)
                if not insert:
                    return matched
            if insert and not present:
                if nxt is None:
                    nxt = self._next[h] = []
                nxt.insert(i, blk)
            if len(blk) == step:
                h = self._chain(h, blk)
        return len(data) // 4 if matched is None else matched
