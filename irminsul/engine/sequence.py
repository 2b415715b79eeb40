"""One request's state inside the engine: its tokens, slot table, reuse plan, output text and stats."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from irminsul.engine.sampling import SamplingParams
from irminsul.kvcache.admission import Admission
from irminsul.kvcache.planner import Plan
from irminsul.model.attention import EMPTY_SLOT

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher

_ids = itertools.count()


@dataclass
class RequestStats:
    """Where each prompt token's rows came from. prompt = prefix + reused + computed;
    carve_out_tokens is the part of computed_tokens that the cache had but the sink rule recomputed."""

    prompt_tokens: int = 0
    prefix_tokens: int = 0
    reused_tokens: int = 0
    carve_out_tokens: int = 0
    computed_tokens: int = 0
    s1_tokens: int = 0
    recomputed_tokens: int = 0  # pic+r: reused rows recomputed (counted in computed_tokens)
    generated_tokens: int = 0
    preempted: int = 0  # times the request lost its rows to make room and was recomputed

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (before temperature, top-k and top-p:
    what `LLM.score` gives), and the most likely alternatives at its position, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    stop: bool = False  # the stop token that ended the sequence: scored, but not in the output

    @classmethod
    def of(cls, logprobs: torch.Tensor, token: int, n: int, stop: bool = False) -> TokenLogprob:
        """From one position's log-probs [vocab]: the token's, and the n most likely (n = 0: none)."""
        top = logprobs.topk(n) if n else None
        return cls(
            token,
            float(logprobs[token]),
            tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else (),
            stop,
        )


@dataclass(eq=False)
class Sequence:
    """A request inside the engine. The scheduler sets its slot table and pending positions from
    what the KV manager hands it (`admit`, `place`, `recompute`, `release`) and consumes them
    (`take_pending`); the output processor appends tokens and text."""

    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    params: SamplingParams
    segment_starts: list[int] | None = None
    tenant: str | None = None  # cache namespace; None means the engine's default
    stats: RequestStats = field(default_factory=RequestStats)
    reuse_plan: Plan | None = None  # the cache planner's plan, until freed
    registered: int = 0  # prompt positions whose chunks were offered to the cache (in-flight reuse)
    seed: int = 0  # sampling randomness is a function of (seed, output position): engine/sampling.py
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    error: str | None = None  # why the engine could not serve it (with finish_reason "abort")
    error_status: int = 500  # whose fault, as an HTTP status: 500 the server's, 400 the request's
    text: str = ""  # output text so far, stop strings cut
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, when asked for
    detok: Callable[[int], str] | None = None  # incremental detokenizer: a token in, the text it completes out
    matcher: LLMatcher | None = None  # the grammar's state when the output is constrained (engine/grammar.py)
    # Another choice of the same prompt (n > 1): this one shares its prompt rows instead of computing them
    leader: Sequence | None = field(default=None, repr=False)
    id: int = field(default_factory=lambda: next(_ids))
    # Pool slot of each position's row (EMPTY_SLOT: not computed yet); the sequence holds one
    # reference on each slot it names. A view of _buf, which doubles as decoding grows it.
    _slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    _buf: np.ndarray | None = field(default=None, repr=False)
    _pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)  # positions to compute

    @property
    def slots(self) -> np.ndarray:
        return self._slots

    @property
    def pending(self) -> np.ndarray:
        return self._pending

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        return len(self._pending) > 0

    @property
    def admitted(self) -> bool:
        return len(self._slots) > 0

    @property
    def filled(self) -> int:
        """Positions 0..filled-1 all have rows (the rows a finished sequence can hand to the cache)."""
        empty = np.flatnonzero(self._slots == EMPTY_SLOT)
        return int(empty[0]) if len(empty) else len(self._slots)

    # -- rows, as the KV manager hands them out ---------------------------------------------

    def admit(self, admission: Admission) -> None:
        """The KV manager's admission: a slot table (rows it reuses; EMPTY_SLOT where it computes),
        the positions to compute, the plan that produced them and where its prompt's rows come from."""
        self._slots, self._buf, self._pending = admission.slots, None, admission.pending
        self.reuse_plan, self.registered = admission.plan, 0
        for name, value in admission.stats._asdict().items():
            setattr(self.stats, name, value)

    def place(self, positions: np.ndarray, slots: np.ndarray) -> None:
        """Fresh rows for positions (computed next)."""
        self._slots[positions] = slots

    def recompute(self, positions: np.ndarray) -> None:
        """pic+r: reused rows at positions are computed in this context instead."""
        self._slots[positions] = EMPTY_SLOT
        self._pending = np.union1d(self._pending, positions)
        self.stats.recomputed_tokens = len(positions)
        self.stats.reused_tokens -= len(positions)
        self.stats.computed_tokens += len(positions)

    def extend_pending(self, positions: np.ndarray) -> None:
        """More positions to compute (scoring's continuation)."""
        self._pending = np.concatenate([self._pending, positions])

    def release(self) -> None:
        """Every row is given back (the KV manager released the references: `KVCacheManager.free`)."""
        self._slots, self._buf, self._pending = np.zeros(0, np.int64), None, np.zeros(0, np.int64)
        self.reuse_plan = None

    def grow(self) -> None:
        """Make the slot table as long as the tokens (a decoded token's row is computed next step);
        the table is a view of a buffer that doubles, so decoding does not copy it every token."""
        n = len(self.tokens)
        if len(self._slots) >= n:
            return
        if self._buf is None or len(self._buf) < n:
            buf = np.zeros(max(n, 2 * len(self._slots), 16), np.int64)
            buf[: len(self._slots)] = self._slots
            self._buf = buf
        self._slots = self._buf[:n]

    # -- the scheduler's ------------------------------------------------------------------

    def take_pending(self, budget: int) -> np.ndarray:
        """The next (at most budget) positions to compute, no longer pending."""
        take, self._pending = self._pending[:budget], self._pending[budget:]
        return take
