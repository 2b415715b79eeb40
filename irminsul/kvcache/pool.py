"""The latent pool: every cached row of one engine, in one preallocated tensor, by token slot.

`rows` is [n_layers, n_slots, kv_lora_rank + rope_dim]. A sequence maps each of its positions to
a slot (its slot table); the radix tree and the content registry hold slot arrays too. Slots are
reference counted: a running sequence, a radix node and a registry entry each hold one reference
on every slot they name, and a slot returns to the free list when its last holder lets go. So a
document used by N sequences at N different offsets is stored once.

Why token slots and not pages (vLLM and FlashMLA use pages of 16-64 tokens): a content hit lands
at any offset (CDC chunk boundaries and S1 windows fall anywhere), so a reused run rarely starts
on a page boundary of the sequence that reuses it. With token slots (as SGLang's token-to-KV pool)
any run of rows can be shared as it is. Slot 0 is never handed out: it stands for "no row".

The rows' `k_r` is stored un-rotated (see `irminsul/model/attention.py`), so a row has no position
in it; `computed_at` still records the position each row was computed at, which the `naive`
baseline (stale `k_r`) and the store tiers need.
"""

from __future__ import annotations

import numpy as np
import torch

from irminsul.kvcache.store.codec import row_bytes
from irminsul.model.attention import EMPTY_SLOT
from irminsul.model.config import ModelConfig


class LatentPool:
    def __init__(self, cfg: ModelConfig, n_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        if n_slots < 2:
            raise ValueError(f"the pool needs at least 2 slots (slot 0 is reserved), got {n_slots}")
        # NOTE: torch.empty: pages are committed as slots are first written, so an engine's pool costs
        # only what it uses until it fills. Slot 0 is zeroed: padding reads it (masked). A captured decode
        # step's padding rows write theirs there (model/graphs.py): finite, and never attended to.
        self.rows = torch.empty(cfg.num_hidden_layers, n_slots, cfg.row_width, dtype=dtype, device=device)
        self.rows[:, EMPTY_SLOT] = 0
        self.bytes_per_slot = row_bytes(cfg.num_hidden_layers, cfg.row_width, dtype)
        self.refs = np.zeros(n_slots, np.int32)
        self.refs[EMPTY_SLOT] = 1  # never freed
        self.computed_at = np.zeros(n_slots, np.int64)
        # free slots as a stack kept in decreasing order, lowest on top: a lightly used pool touches
        # few pages, and an allocation is an increasing run of slots wherever the free ones allow,
        # which attention reads in place (AttentionGroup.run). _free[:_sorted] is in order; slots
        # released since are pushed above it and merged in at the next allocation.
        self._free = np.arange(n_slots - 1, EMPTY_SLOT, -1, dtype=np.int64)
        self._top = self._sorted = len(self._free)

    @classmethod
    def sized(cls, cfg: ModelConfig, nbytes: int, dtype: torch.dtype, device="cpu") -> LatentPool:
        return cls(cfg, max(2, nbytes // row_bytes(cfg.num_hidden_layers, cfg.row_width, dtype)), dtype, device)

    def describe(self) -> str:
        """Its size for people: rows (tokens) and MiB."""
        return f"{self.n_slots - 1:,} rows, {self.capacity_bytes / 2**20:.1f} MiB"

    @property
    def n_slots(self) -> int:
        return len(self.refs)

    @property
    def free(self) -> int:
        return self._top

    @property
    def used(self) -> int:
        """Slots holding a row someone refers to (slot 0 excluded)."""
        return self.n_slots - 1 - self._top

    @property
    def capacity_bytes(self) -> int:
        return (self.n_slots - 1) * self.bytes_per_slot

    @property
    def used_bytes(self) -> int:
        return self.used * self.bytes_per_slot

    def alloc(self, n: int) -> np.ndarray | None:
        """n fresh slots, each with one reference, or None (and nothing taken) if fewer are free."""
        if n > self._top:
            return None
        if self._sorted < self._top:
            self._merge_released()
        out = self._free[self._top - n : self._top][::-1].copy()
        self._top = self._sorted = self._top - n
        self.refs[out] = 1
        return out

    def retain(self, slots: np.ndarray) -> None:
        """One more reference on each slot (a slot may appear several times)."""
        slots = np.asarray(slots, np.int64)
        np.add.at(self.refs, slots[slots != EMPTY_SLOT], 1)

    def release(self, slots: np.ndarray) -> None:
        """Drop one reference from each slot; slots nobody refers to any more are freed."""
        slots = np.asarray(slots, np.int64)
        slots = slots[slots != EMPTY_SLOT]
        if not len(slots):
            return
        np.subtract.at(self.refs, slots, 1)
        touched = np.unique(slots)
        if (self.refs[touched] < 0).any():
            raise RuntimeError("a pool slot was released more often than it was held")
        freed = touched[self.refs[touched] == 0]
        self._free[self._top : self._top + len(freed)] = freed
        self._top += len(freed)

    def _merge_released(self) -> None:
        """Merge the slots released since the last allocation into the ordered stack (O(free))."""
        ordered = self._free[: self._sorted][::-1]  # increasing
        released = np.sort(self._free[self._sorted : self._top])
        self._free[: self._top] = np.insert(ordered, np.searchsorted(ordered, released), released)[::-1]
        self._sorted = self._top

    def mark_computed(self, slots: np.ndarray, positions) -> None:
        """The rows in slots are (about to be) computed at positions (what `naive` reads keys at)."""
        self.computed_at[slots] = positions

    def write(self, slots: np.ndarray, rows: torch.Tensor, positions: np.ndarray) -> None:
        """Store rows [n_layers, n, width] (as the pool holds them) computed at `positions` in slots.
        Rows in host memory go to a GPU pool through a pinned staging copy, so the transfer is a
        DMA the copy engine runs beside the compute stream."""
        if self.rows.is_cuda and not rows.is_cuda and not rows.is_pinned():
            rows = rows.pin_memory()
        idx = torch.as_tensor(slots, device=self.rows.device)
        self.rows.index_copy_(1, idx, rows.to(self.rows.device, self.rows.dtype, non_blocking=True))
        self.mark_computed(slots, positions)

    def read(self, slots: np.ndarray) -> torch.Tensor:
        """Rows [n_layers, n, width] of slots (a copy, on the pool's device)."""
        return self.rows[:, torch.as_tensor(slots, device=self.rows.device)]

    def read_host(self, slots: np.ndarray) -> torch.Tensor:
        """Rows of slots in host memory (for the disk and Redis tiers): on a GPU into pinned memory."""
        rows = self.read(slots)
        if not rows.is_cuda:
            return rows
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows)  # (synchronous: the tier reads it next)
        return host
