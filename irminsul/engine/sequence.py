"""One request's state inside the engine: its tokens, latent rows, reuse plan and stats."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from irminsul.engine.sampling import SamplingParams
from irminsul.model.mla import SequenceRows

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

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Sequence:
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    params: SamplingParams
    rows: SequenceRows
    segment_starts: list[int] | None = None
    tenant: str | None = None  # cache namespace; None means the engine's default
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # positions to compute
    stats: RequestStats = field(default_factory=RequestStats)
    plan: object | None = None  # the cache's plan, kept until finish() releases its pins
    generator: torch.Generator | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    text_offset: int = 0  # characters of output already checked for stop strings
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        return len(self.pending) > 0
