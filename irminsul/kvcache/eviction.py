"""One eviction order over the pool's rows that only caches hold.

The radix tree and the content registry both name pool slots, often the same ones (a finished
prompt is in the tree and its chunks in the registry). Neither decides what to evict: each slot
they name is counted here (`held`: how many cache holdings name it) and stamped when it is stored
or reused (`stamp`). A slot is evictable when caches are its only holders (`refs == held`), and
making room for n rows takes the n evictable slots with the oldest stamps; the KV manager then
tells both structures to forget whatever names those slots, and the slots come free.

Within one holding the stamp falls from head to tail, so of a prefix stored or reused at the same
moment the tail goes first and the prefix keeps its head (vLLM's BlockPool frees a request's
blocks in reverse for the same reason). Pure numpy: no model, no device.
"""

from __future__ import annotations

import numpy as np

# a stamp is (tick, rank within the holding); a holding longer than this shares ranks at its tail
_RANKS = 1 << 24


class EvictionOrder:
    def __init__(self, n_slots: int):
        self.held = np.zeros(n_slots, np.int32)  # cache holdings naming each slot
        self.stamp = np.zeros(n_slots, np.int64)  # when it was last stored or reused; older goes first
        self._tick = 0

    def hold(self, slots: np.ndarray) -> None:
        """A cache starts holding `slots` (in sequence order: head first)."""
        np.add.at(self.held, slots, 1)
        self.touch(slots)

    def unhold(self, slots: np.ndarray) -> None:
        np.subtract.at(self.held, slots, 1)

    def touch(self, slots: np.ndarray) -> None:
        """`slots` (head first) were just used: they go after everything stamped before."""
        self._tick += 1
        rank = np.minimum(np.arange(len(slots), 0, -1), _RANKS - 1)  # the head ranks highest
        self.stamp[slots] = self._tick * _RANKS + rank

    def evictable(self, refs: np.ndarray, protected: np.ndarray | None = None) -> np.ndarray:
        """Slots only caches hold (every reference on them is a cache holding), in slot order.
        `protected`: a mask of slots to leave alone."""
        mask = (self.held > 0) & (refs == self.held)
        if protected is not None:
            mask &= ~protected
        return np.flatnonzero(mask)

    def oldest(self, candidates: np.ndarray, k: int) -> np.ndarray:
        """The k candidates with the oldest stamps (all of them if there are at most k)."""
        if k >= len(candidates):
            return candidates
        return candidates[np.argpartition(self.stamp[candidates], k - 1)[:k]]
