"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded.

Any value that passes validation samples: a temperature below 1e-5 (vLLM's threshold) is greedy,
and so is a top_p too small to keep more than the most likely token once it is float32 (1e-50 is
0 there); a distribution that still degenerates (non-finite, or nothing left) falls back to greedy
instead of failing the step that every other running request shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from irminsul.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N >= 0: each sampled token's log-prob and the N most likely

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise RequestError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and 0.0 <= self.temperature <= 100.0):
            raise RequestError(f"temperature={self.temperature!r} must be in [0, 100]")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**63):
            raise RequestError(f"seed={self.seed!r} must be an integer in [0, 2^63)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise RequestError(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(f"logprobs={self.logprobs!r} must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop must be a non-empty string or a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1 or self.top_p < GREEDY_BELOW


GREEDY_BELOW = 1e-5  # a temperature or top_p below this samples the most likely token
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [vocab] (float32) -> one token id."""
    if params.greedy:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest set whose mass reaches top_p (the first token is always kept)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop[0] = False  # NOTE: in float32 a tiny top_p is 0, and 0 >= 0 would drop the first token too
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    total = float(probs.sum())
    if not math.isfinite(total) or total <= 0.0 or not bool(torch.isfinite(probs).all()):
        return int(logits.argmax())  # a degenerate distribution: the most likely token
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
