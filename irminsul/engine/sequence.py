"""One request's state inside the engine: its tokens, slot table, reuse plan, output text and stats."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

import numpy as np

from irminsul.engine.sampling import SamplingParams
from irminsul.model.attention import EMPTY_SLOT

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
    def of(cls, logprobs, token: int, n: int, stop: bool = False) -> TokenLogprob:
        """From one position's log-probs [vocab]: the token's, and the n most likely (n = 0: none)."""
        top = logprobs.topk(n) if n else None
        return cls(token, float(logprobs[token]),
                   tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else (), stop)


@dataclass(eq=False)
class Sequence:
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    params: SamplingParams
    segment_starts: list[int] | None = None
    tenant: str | None = None  # cache namespace; None means the engine's default
    # Pool slot of each position's row (EMPTY_SLOT: not computed yet). The sequence holds one
    # reference on each slot it names.
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # positions to compute
    stats: RequestStats = field(default_factory=RequestStats)
    plan: object | None = None  # the cache's plan, kept until finish() releases its pins
    registered: int = 0  # prompt positions whose chunks were offered to the cache (in-flight reuse)
    seed: int = 0  # sampling randomness is a function of (seed, output position): engine/sampling.py
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    error: str | None = None  # why the engine could not serve it (with finish_reason "abort")
    error_status: int = 500  # whose fault, as an HTTP status: 500 the server's, 400 the request's
    text: str = ""  # output text so far, stop strings cut
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, when asked for
    detok: object | None = None  # incremental detokenizer state
    matcher: object | None = None  # the grammar's state when the output is constrained (engine/grammar.py)
    # Another choice of the same prompt (n > 1): this one shares its prompt rows instead of computing them
    leader: Sequence | None = field(default=None, repr=False)
    id: int = field(default_factory=lambda: next(_ids))
    _buf: np.ndarray | None = field(default=None, repr=False)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        return len(self.pending) > 0

    @property
    def admitted(self) -> bool:
        return len(self.slots) > 0

    @property
    def filled(self) -> int:
        """Positions 0..filled-1 all have rows (the rows a finished sequence can hand to the cache)."""
        empty = np.flatnonzero(self.slots == EMPTY_SLOT)
        return int(empty[0]) if len(empty) else len(self.slots)

    def grow(self) -> None:
        """Make the slot table as long as the tokens (a decoded token's row is computed next step);
        the table is a view of a buffer that doubles, so decoding does not copy it every token."""
        n = len(self.tokens)
        if len(self.slots) >= n:
            return
        if self._buf is None or len(self._buf) < n:
            buf = np.zeros(max(n, 2 * len(self.slots), 16), np.int64)
            buf[: len(self.slots)] = self.slots
            self._buf = buf
        self.slots = self._buf[:n]
