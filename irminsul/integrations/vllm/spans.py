"""The engine-agnostic half of an Irminsul integration: what a request's prompt is made of.

An engine that pages its KV cache (vLLM, SGLang) keeps its own blocks, its own scheduler and its own
model; Irminsul keeps the content index: the CDC chunker, the verified registry, the S1 windows, the
planner with its sink carve-out. Between them this module speaks only token ids, positions and
fingerprints:

- `SpanIndex.plan(token_ids)` -> a `RequestSpans`: the prompt as compute / load spans, each load
  naming a stored chunk (fingerprint, row offset inside it, the RoPE shift δ);
- `SpanIndex.to_save(spans, upto)` -> the chunks whose rows exist once the engine has computed or
  loaded rows [0, upto), which the engine must copy out of its cache under their fingerprints;
- `SpanIndex.evicted()` -> fingerprints the registry dropped, whose rows the engine may free.

Rows never pass through here: the engine's worker holds them (see `connector.py`). Nothing here
imports an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from irminsul.cache.chunker import Chunk, ChunkerConfig, namespace_seed
from irminsul.cache.planner import Plan, Planner, PlannerConfig
from irminsul.cache.registry import MemoryRegistry
from irminsul.cache.windows import WindowIndex


@dataclass(frozen=True)
class Load:
    """Rows [start, end) of the prompt come from a stored chunk: its rows [src_offset, src_offset +
    len), computed at source positions that are `delta` positions before the target ones."""
    start: int
    end: int
    fingerprint: int
    src_offset: int
    delta: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class RequestSpans:
    plan: Plan
    loads: list[Load]  # sorted, disjoint
    saved: set[int] = field(default_factory=set)  # fingerprints already handed to the engine to save

    @property
    def n(self) -> int:
        return len(self.plan.tokens)

    def load_at(self, pos: int) -> list[Load]:
        """The run of loads that starts at pos (adjacent loads together), or []."""
        out: list[Load] = []
        for load in self.loads:
            if load.start == (out[-1].end if out else pos):
                out.append(load)
            elif out:
                break
        return out

    def next_load_start(self, pos: int) -> int | None:
        """Where the next load after pos begins: a compute step must stop there."""
        return next((load.start for load in self.loads if load.start > pos), None)


class SpanIndex:
    """One namespace's content index (chunker, registry, S1 windows, planner) for an engine."""

    def __init__(self, model_id: str, bytes_per_token: int, budget_bytes: int, tenant: str = "",
                 sink: int = 32, chunker: ChunkerConfig | None = None):
        self.bytes_per_token = bytes_per_token
        self.registry = MemoryRegistry(budget_bytes)
        self.windows = WindowIndex(128)
        config = PlannerConfig(chunker=chunker or ChunkerConfig(), sink=sink)
        # radix=None: the engine's own prefix cache serves exact prefixes
        self.planner = Planner(config, self.registry, None, self.windows, namespace_seed(model_id, tenant))
        self._evicted: list[int] = []
        self.registry.on_evict.append(lambda entry: self._evicted.append(entry.fingerprint))

    def plan(self, token_ids) -> RequestSpans:
        plan = self.planner.plan(np.asarray(token_ids, dtype=np.int64))
        loads = [Load(s.start, s.end, s.entry.fingerprint, s.src_offset, s.delta)
                 for s in plan.spans if s.kind == "reuse"]
        return RequestSpans(plan, loads)

    def release(self, spans: RequestSpans) -> None:
        self.planner.release(spans.plan)

    def to_save(self, spans: RequestSpans, upto: int) -> list[Chunk]:
        """Chunks of the prompt that end at or before `upto`, that the registry lacks and that were
        not handed out before; they are registered now (their rows must be saved this step)."""
        out = [c for c in spans.plan.chunks if c.end <= upto and c.fingerprint not in self.registry
               and c.fingerprint not in spans.saved]
        if not out:
            return []
        self.planner.register(spans.plan, lambda s, e: None, lambda n: n * self.bytes_per_token, upto=upto)
        out = [c for c in out if c.fingerprint in self.registry]  # (the budget may refuse some)
        spans.saved.update(c.fingerprint for c in out)
        return out

    def evicted(self) -> list[int]:
        out, self._evicted = self._evicted, []
        return out


def rotate_interleaved(k_pe: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """R(δ)·k_pe for keys whose RoPE pairs are adjacent dims (vLLM's DeepSeek rotary, GPT-J style):
    unit cos/sin, computed in float32 (float64 angles) and rounded once to k_pe's dtype."""
    angles = float(delta) * inv_freq.double()
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    pairs = k_pe.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(k_pe.dtype)
