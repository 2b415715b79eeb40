"""Wall time of a cache hit versus a miss on this machine, for both architectures.

MLA runs through the engine: a miss is `reuse="off"` prefill of the request; a hit is `pic`
after the shared content was cached behind another header (copy, δ-rotate, compute the rest).
GQA runs through transformers, doing what a position-independent GQA cache must: compute the
header, append the cached K/V of the shared span with the *whole* K rotated by δ, compute the
tail. `gqa_hit_logits` is checked against full prefill on a one-layer model in tests/research/eval.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from irminsul.model.config import RopeConfig
from irminsul.model.rope import Rotary


@dataclass(frozen=True)
class MovedSpan:
    """A shared span cached behind one header, then hit behind another: first = other_header + shared
    (cached); prompt = header + shared + tail (the hit), the span moved by `delta`."""

    other_header: list[int]
    header: list[int]
    shared: list[int]
    tail: list[int]

    @property
    def first(self) -> list[int]:
        return self.other_header + self.shared

    @property
    def prompt(self) -> list[int]:
        return self.header + self.shared + self.tail

    @property
    def delta(self) -> int:
        return len(self.header) - len(self.other_header)

    @classmethod
    def random(cls, rng: np.random.Generator, vocab: int, header: int, shared: int, tail: int, head=()) -> MovedSpan:
        def ids(k):
            return rng.integers(16, vocab, k).tolist()

        return cls(
            list(head) + ids(max(1, header - len(head) + 7)),
            list(head) + ids(header - len(head)),
            ids(shared),
            ids(tail),
        )


@dataclass(frozen=True)
class Timing:
    miss_s: float
    hit_s: float
    computed_tokens: int  # what the measured hit computed
    reused_tokens: int

    @property
    def saved_fraction(self) -> float:
        return 1 - self.hit_s / self.miss_s


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_mla(llm, req: MovedSpan, repeats: int = 3) -> Timing:
    from irminsul.engine.build import build_engine
    from irminsul.engine.config import EngineConfig
    from irminsul.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    off = build_engine(EngineConfig.of(reuse="off"), llm.model, llm.tokenizer)
    miss = _median(lambda: off.run(off.add(req.prompt, params)), repeats)
    hits, stats = [], None
    for _ in range(repeats):
        eng = build_engine(EngineConfig.of(reuse="pic"), llm.model, llm.tokenizer)
        eng.run(eng.add(req.first, params))
        t = time.perf_counter()
        seq = eng.run(eng.add(req.prompt, params))
        hits.append(time.perf_counter() - t)
        stats = seq.stats
    return Timing(miss, statistics.median(hits), stats.computed_tokens, stats.reused_tokens)


def llama_rotary(config) -> Rotary:
    """Our rotary class for a Llama-style model (rotate_half layout = the "half" layout)."""
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"rope_type={kind!r}: the GQA hit path supports default RoPE only")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Rotary(RopeConfig(dim=head_dim, theta=float(params.get("rope_theta", 10000.0)), style="v3_half"))


@torch.no_grad()
def gqa_cached_span(model, req: MovedSpan) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) [1, kv_heads, len(shared), d] of the shared span as cached from `first`."""
    out = model(input_ids=torch.tensor([req.first]), use_cache=True, logits_to_keep=1)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    a = len(req.other_header)
    return [(layer.keys[:, :, a:].clone(), layer.values[:, :, a:].clone()) for layer in cache.layers]


@torch.no_grad()
def gqa_hit_logits(model, rotary: Rotary, req: MovedSpan, span) -> torch.Tensor:
    """Header computed, shared K/V appended (K rotated by δ: every head, every dim), tail computed."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([req.header]), cache=cache, use_cache=True, logits_to_keep=1)
    for layer, (k, v) in zip(cache.layers, span):
        k = rotary.rotate(k[0].transpose(0, 1), req.delta).transpose(0, 1)[None]  # [1, KV, S, d]
        layer.keys = torch.cat([layer.keys, k], dim=2)
        layer.values = torch.cat([layer.values, v], dim=2)
    start = len(req.header) + len(req.shared)
    pos = torch.arange(start, start + len(req.tail))[None]
    return model(
        input_ids=torch.tensor([req.tail]), cache=cache, position_ids=pos, use_cache=True, logits_to_keep=1
    ).logits[0, -1]


def time_gqa(model, req: MovedSpan, repeats: int = 3) -> Timing:
    rotary = llama_rotary(model.config)
    span = gqa_cached_span(model, req)

    def miss():
        with torch.no_grad():
            model(input_ids=torch.tensor([req.prompt]), use_cache=True, logits_to_keep=1)

    return Timing(
        _median(miss, repeats),
        _median(lambda: gqa_hit_logits(model, rotary, req, span), repeats),
        len(req.header) + len(req.tail),
        len(req.shared),
    )
