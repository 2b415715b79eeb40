"""What the KV manager hands the scheduler when a sequence is admitted, and what it reads of one.

The manager never writes into a sequence: it returns an `Admission` (the slot table, the positions
left to compute, the plan and where the prompt's rows come from) and fresh slots for positions,
and the scheduler applies them to its own `Sequence` (as vLLM's `KVCacheBlocks` is the interface
between its scheduler and its KV cache manager). `CachedSequence` is what the manager reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from irminsul.kvcache.planner import Plan


class AdmissionStats(NamedTuple):
    """Where each prompt token's rows come from: prompt = prefix + reused + computed;
    carve_out_tokens is the part of computed_tokens the cache had but the sink rule recomputes."""

    prompt_tokens: int
    prefix_tokens: int
    reused_tokens: int
    computed_tokens: int
    carve_out_tokens: int = 0
    s1_tokens: int = 0


@dataclass(frozen=True, eq=False)
class Admission:
    slots: np.ndarray  # [prompt_len] the pool slot of each position's row; EMPTY_SLOT where it is computed
    pending: np.ndarray  # [n] positions to compute, increasing
    plan: Plan | None  # the reuse plan (None: nothing was planned)
    stats: AdmissionStats


class CachedSequence(Protocol):
    """What the KV manager reads of a sequence (the engine's `Sequence` is one)."""

    @property
    def tokens(self) -> list[int]: ...
    @property
    def prompt_len(self) -> int: ...
    @property
    def segment_starts(self) -> list[int] | None: ...
    @property
    def tenant(self) -> str | None: ...
    @property
    def slots(self) -> np.ndarray: ...  # [len(tokens)] or shorter; EMPTY_SLOT where not computed
    @property
    def pending(self) -> np.ndarray: ...
    @property
    def in_prefill(self) -> bool: ...
    @property
    def filled(self) -> int: ...  # positions [0, filled) all have rows
    @property
    def reuse_plan(self) -> Plan | None: ...
    @property
    def registered(self) -> int: ...  # prompt positions whose chunks were offered to the cache
    @property
    def finish_reason(self) -> str | None: ...
