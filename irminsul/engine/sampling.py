"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded.

Any value that passes validation samples: a temperature below 1e-5 (vLLM's threshold) is greedy,
and so is a top_p too small to keep more than the most likely token once it is float32 (1e-50 is
0 there); a distribution that still degenerates (non-finite, or nothing left) falls back to greedy
instead of failing the step that every other running request shares.
"""

from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass, field

import torch

from irminsul.engine.grammar import Constraint
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
    # logit controls, applied before greedy or sampled choice (`adjust_logits`)
    presence_penalty: float = 0.0  # OpenAI: minus this from every token generated at least once
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often a token was generated
    repetition_penalty: float = 1.0  # HF/vLLM: logits of prompt and output tokens divided (>0) or multiplied (<0)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (sampling only)
    min_tokens: int = 0  # EOS and stop_token_ids are not sampled before this many tokens
    include_stop_str_in_output: bool = False
    constraint: Constraint | None = None  # structured output: the text must match it (engine/grammar.py)
    skip_special_tokens: bool = True  # False: special tokens' text is in the output (tool-call markers)
    # logit_bias as tensors, built once per (device, vocabulary) and reused every step (`_bias_on`)
    _bias: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise RequestError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not (
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and 0.0 <= self.temperature <= 100.0
        ):
            raise RequestError(f"temperature={self.temperature!r} must be in [0, 100]")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63
        ):
            raise RequestError(f"seed={self.seed!r} must be an integer in [0, 2^63)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise RequestError(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise RequestError(f"logprobs={self.logprobs!r} must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value <= hi):
                raise RequestError(f"{name}={value!r} must be in [{lo:g}, {hi:g}]")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0.0 < self.repetition_penalty <= 10.0):
            raise RequestError(f"repetition_penalty={self.repetition_penalty!r} must be in (0, 10]")
        if (
            not isinstance(self.min_tokens, int)
            or isinstance(self.min_tokens, bool)
            or not 0 <= self.min_tokens <= self.max_tokens
        ):
            raise RequestError(f"min_tokens={self.min_tokens!r} must be an integer in [0, max_tokens]")
        bias = self.logit_bias
        if not isinstance(bias, (tuple, list, dict)):
            raise RequestError("logit_bias must be (token id, bias) pairs or a {token id: bias} dict")
        if len(bias) > MAX_LOGIT_BIAS:  # (before reading the entries: there may be a vocabulary's worth)
            raise RequestError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        if isinstance(bias, dict):  # OpenAI's {token id: bias}
            bias = tuple(bias.items())
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in bias):
            raise RequestError("logit_bias must be (token id, bias) pairs or a {token id: bias} dict")
        if any(not _is_int(t) for t, _ in bias):
            raise RequestError("logit_bias token ids must be integers")
        if any(not (isinstance(b, (int, float)) and not isinstance(b, bool) and -100.0 <= b <= 100.0) for _, b in bias):
            raise RequestError("logit_bias values must be in [-100, 100]")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or any(not isinstance(s, str) or not s for s in stop):
            raise RequestError("stop must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = (self.stop_token_ids,) if _is_int(self.stop_token_ids) else self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or not all(_is_int(t) for t in ids):
            raise RequestError("stop_token_ids must be a token id or a list of token ids (integers)")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1 or self.top_p < GREEDY_BELOW

    @property
    def adjusts_logits(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def _bias_on(self, device: torch.device, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """logit_bias as rounds of (ids [n] int64, biases [n] float32) on `device`, ids outside
        [0, vocab) left out; built on first use, then every step adds each round with one index_add_.
        An id listed k times is in the first k rounds, so no round repeats an id (index_add_'s order
        over repeated ids is not fixed on a GPU): each logit gets its biases one at a time, in order."""
        key = (device, vocab)
        if key not in self._bias:
            rounds: list[list[tuple[int, float]]] = []
            times: dict[int, int] = {}  # id -> how often it came so far
            for token, bias in self.logit_bias:
                if 0 <= token < vocab:
                    k = times[token] = times.get(token, 0) + 1
                    if k > len(rounds):
                        rounds.append([])
                    rounds[k - 1].append((token, bias))
            self._bias[key] = [
                (
                    torch.tensor([t for t, _ in r], dtype=torch.long, device=device),
                    torch.tensor([b for _, b in r], dtype=torch.float32, device=device),
                )
                for r in rounds
            ]
        return self._bias[key]


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int], banned_until_min: list[int]
) -> torch.Tensor:
    """logits [vocab] -> the logits the choice is made from: logit bias, penalties (vLLM's
    definitions) and, before min_tokens, the end tokens masked out."""
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.as_tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if output and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.as_tensor(output, dtype=torch.long), minlength=vocab)[:vocab].float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    for ids, values in params._bias_on(logits.device, vocab):
        logits.index_add_(0, ids, values)
    if len(output) < params.min_tokens and banned_until_min:
        logits[torch.as_tensor(banned_until_min, dtype=torch.long)] = float("-inf")
    return logits


GREEDY_BELOW = 1e-5  # a temperature or top_p below this samples the most likely token
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_LOGIT_BIAS = 300  # OpenAI's limit for logit_bias entries


def request_seed(seed: int | None) -> int:
    """The seed a request samples with: its own, or a fresh random one (then it is not reproducible)."""
    return seed if seed is not None else secrets.randbits(62)


_M64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


_MIX1, _MIX2, _GOLDEN = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(0x9E3779B97F4A7C15)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 as if unsigned (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def uniforms(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) [B, vocab] float32 from a counter-based hash (splitmix64) of (seed, step, token id):
    the same numbers on any device, for any batch a sequence shares, whatever ran before. int64
    products wrap as unsigned ones do, so the hash is exact in torch integer ops.

    NOTE: the interval is open (`unit_interval`). The top 23 bits plus one half, over 2^23, are
    exact in float32 (largest 1 - 2^-24, smallest 2^-24); with 24 bits the largest value rounds
    to 1.0, whose exponential is 0, and the race then divides by zero."""
    if seeds.device.type == "cpu":
        return _uniforms_blocked(seeds, steps, vocab)
    return _uniforms_whole(seeds, steps, vocab)


def _uniforms_whole(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """`uniforms` over the whole [B, vocab] at once: one kernel a pass (an accelerator's way)."""
    x = seeds[:, None] * _GOLDEN + steps[:, None] * _MIX2 + torch.arange(vocab, device=seeds.device)[None, :]
    for _ in range(2):
        x = x + _GOLDEN
        x = (x ^ _shr(x, 30)) * _MIX1
        x = (x ^ _shr(x, 27)) * _MIX2
        x = x ^ _shr(x, 31)
    return unit_interval(x)


_BLOCK = 1 << 16  # int64 counters hashed at once on a CPU: 512 KiB, two buffers within a core's L2


def _uniforms_blocked(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """`uniforms` on a CPU, the same numbers: in place, about `_BLOCK` counters at a time (a few
    rows of a small vocabulary, or a slice of one row of a large one), so the hash's dozen passes
    stay in cache. The whole [B, vocab] at once spilled it, an order of magnitude slower for a batch
    of a large vocabulary's rows."""
    base = (seeds * _GOLDEN + steps * _MIX2)[:, None]
    columns = torch.arange(vocab)[None, :]
    out = torch.empty(len(seeds), vocab, dtype=torch.float32)
    rows, width = max(1, _BLOCK // vocab), min(vocab, _BLOCK)
    x, tmp = torch.empty(rows, width, dtype=torch.long), torch.empty(rows, width, dtype=torch.long)

    def shr(v: torch.Tensor, t: torch.Tensor, k: int) -> torch.Tensor:
        torch.bitwise_right_shift(v, k, out=t)
        return t.bitwise_and_((1 << (64 - k)) - 1)

    for r in range(0, len(seeds), rows):
        r_end = min(len(seeds), r + rows)
        for c in range(0, vocab, width):
            c_end = min(vocab, c + width)
            v, t = x[: r_end - r, : c_end - c], tmp[: r_end - r, : c_end - c]
            torch.add(columns[:, c:c_end], base[r:r_end], out=v)
            for _ in range(2):
                v.add_(_GOLDEN)
                v.bitwise_xor_(shr(v, t, 30)).mul_(_MIX1)
                v.bitwise_xor_(shr(v, t, 27)).mul_(_MIX2)
                v.bitwise_xor_(shr(v, t, 31))
            o = out[r:r_end, c:c_end]
            o.copy_(shr(v, t, 64 - _UNIFORM_BITS))
            o.add_(0.5).div_(float(1 << _UNIFORM_BITS))
    return out


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """int64 hash values -> float32 in (0, 1), open at both ends: the top 23 bits k as (k + 0.5) / 2^23."""
    return (_shr(bits, 64 - _UNIFORM_BITS).float() + 0.5) / float(1 << _UNIFORM_BITS)


_UNIFORM_BITS = 23  # float32's mantissa: k + 0.5 for k < 2^23 is exact


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], steps: list[int]
) -> torch.Tensor:
    """logits [B, vocab] -> token ids [B] (on the logits' device, no host synchronisation): each row
    greedy or sampled after temperature, top-k, min-p and top-p, by an exponential race
    (argmax p / E, E ~ Exp(1) from `uniforms`): the sampled row's distribution exactly, with the
    randomness fixed by (seed, step). A degenerate row (nothing finite left) takes its argmax.

    A token of probability 0 (masked by a grammar, cut by top-k/top-p/min-p, -inf logits) never
    wins: the race runs in log space, log p - log E with E > 0 (`uniforms` is open), and such a
    token's score is -inf."""
    dev, vocab = logits.device, logits.shape[-1]
    logits = logits.float()
    # (max's indices are argmax's, the first maximum, NaN first, and several times faster on a CPU)
    chosen = logits.max(-1).indices
    # only the sampled rows race (the host knows which: no synchronisation); greedy rows take the argmax
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return chosen
    if len(rows) < len(params):
        params, seeds, steps = [params[i] for i in rows], [seeds[i] for i in rows], [steps[i] for i in rows]
        sampled = logits[torch.tensor(rows, device=dev)]
    else:
        sampled = logits
    temp = torch.tensor([p.temperature for p in params], device=dev)
    x = sampled / temp[:, None]
    if any(p.top_k or p.top_p < 1.0 or p.min_p > 0.0 for p in params if not p.greedy):
        # a top_k past the vocabulary keeps everything (any size is valid; int64 holds the clamp)
        top_k = torch.tensor([min(p.top_k, vocab) or vocab for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        srt, order = x.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev)[None, :]
        srt = srt.masked_fill(rank >= top_k[:, None], float("-inf"))
        probs = srt.softmax(-1)
        drop = (probs < min_p[:, None] * probs[:, :1]) | (probs.cumsum(-1) - probs >= top_p[:, None])
        drop[:, 0] = False  # the most likely token is always kept
        x = torch.full_like(x, float("-inf")).scatter_(1, order, srt.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    exp = -torch.log(uniforms(torch.tensor(seeds, device=dev), torch.tensor(steps, device=dev), vocab))  # > 0
    race = torch.where(probs > 0, probs.log() - exp.log(), float("-inf"))
    bad = ~torch.isfinite(probs).all(-1) | (probs.sum(-1) <= 0)
    won = torch.where(bad, sampled.max(-1).indices, race.max(-1).indices)
    if len(rows) == len(chosen):
        return won
    return chosen.index_copy(0, torch.tensor(rows, device=dev), won)


def sample(logits: torch.Tensor, params: SamplingParams, seed: int | None = None, step: int = 0) -> int:
    """logits [vocab] -> one token id (`sample_batch` for one row)."""
    return int(sample_batch(logits[None], [params], [request_seed(seed)], [step])[0])


def _is_int(x) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
