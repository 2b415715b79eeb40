"""The engine-agnostic half of an Irminsul integration: what a request's prompt is made of.

An engine that pages its KV cache (vLLM, SGLang) keeps its own blocks, its own scheduler and its own
model; Irminsul keeps the content index: the CDC chunker, the verified registry, the S1 windows, the
planner with its sink carve-out. Between them this module speaks only token ids, positions and
fingerprints:

- `SpanIndex.plan(token_ids, tenant)` -> a `RequestSpans`: the prompt as compute / load spans, each
  load naming a stored chunk (its key, row offset inside it, the RoPE shift δ);
- `SpanIndex.to_save(spans, upto)` -> the chunks whose rows exist once the engine has computed or
  loaded rows [0, upto), which the engine must copy out of its cache under their keys;
- `SpanIndex.evicted()` -> keys the registry dropped, whose rows the engine frees;
- `SpanIndex.lose(keys)` -> the engine lacks these rows after all: their entries are never planned again.

Rows never pass through here: the engine's worker holds them (see `connector.py`), under a key that
each registration of a chunk gets anew (the entry's payload). A chunk evicted and registered again
gets a new key, so a drop of its old rows can never remove the new ones, in whatever step either
reaches the worker. Tenants are Irminsul's namespaces (`irminsul/kvcache/namespaces.py`): each
searches its own entries, then the operator's `SHARED` ones. Nothing here imports an engine.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from irminsul.kvcache.chunker import ChunkerConfig
from irminsul.kvcache.namespaces import Namespaces
from irminsul.kvcache.planner import Plan, Planner, PlannerConfig
from irminsul.kvcache.radix import RadixCache
from irminsul.kvcache.registry import MemoryRegistry


@dataclass(frozen=True)
class Load:
    """Rows [start, end) of the prompt come from a stored chunk: its rows [src_offset, src_offset +
    len), computed at source positions that are `delta` positions before the target ones."""
    start: int
    end: int
    key: int  # the stored rows' key (Save.key of the step that saved them)
    src_offset: int
    delta: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Save:
    """Rows [start, end) of the prompt exist now: the engine copies them out under `key`."""
    start: int
    end: int
    key: int


@dataclass
class RequestSpans:
    plan: Plan
    loads: list[Load]  # sorted, disjoint
    planner: Planner  # the namespace it was planned in
    tenant: str | None = None  # None: the index's default tenant

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
    """The content index (chunker, registry, S1 windows, planner per tenant) for an engine."""

    def __init__(self, model_id: str, bytes_per_token: int, budget_bytes: int, tenant: str = "",
                 sink: int = 32, chunker: ChunkerConfig | None = None, max_namespaces: int = 1024):
        self.bytes_per_token = bytes_per_token
        self.registry = MemoryRegistry(budget_bytes)
        config = PlannerConfig(chunker=chunker or ChunkerConfig(), sink=sink)
        # NOTE: the engine's own prefix cache serves exact prefixes, so the namespaces' radix tree
        # stays empty (every plan's prefix match is 0 tokens)
        self.namespaces = Namespaces(config, self.registry, RadixCache(0, 1), model_id, tenant, max_namespaces)
        self._keys = itertools.count()
        self._fingerprints: dict[int, int] = {}  # key -> fingerprint, of the entries stored
        self._evicted: list[int] = []
        self._lost: set[int] = set()  # keys whose rows the engine lacks, still pinned by a plan
        self.registry.on_store.append(lambda entry: self._fingerprints.__setitem__(entry.payload, entry.fingerprint))
        self.registry.on_evict.append(self._on_evict)

    def _on_evict(self, entry) -> None:
        self._fingerprints.pop(entry.payload, None)
        self._evicted.append(entry.payload)

    def plan(self, token_ids, tenant: str | None = None) -> RequestSpans:
        planner = self.namespaces.planner(tenant)
        plan = planner.plan(np.asarray(token_ids, dtype=np.int64))
        loads = [Load(s.start, s.end, s.entry.payload, s.src_offset, s.delta)
                 for s in plan.spans if s.kind == "reuse" and s.entry.payload not in self._lost]
        return RequestSpans(plan, loads, planner, tenant)

    def release(self, spans: RequestSpans) -> None:
        spans.planner.release(spans.plan)
        for key in [k for k in self._lost if self._discard(k)]:
            self._lost.discard(key)

    def to_save(self, spans: RequestSpans, upto: int) -> list[Save]:
        """Chunks of the prompt that end at or before `upto` and that the registry lacks: they are
        registered now, and their rows must be saved this step."""
        if all(c.end > upto or c.fingerprint in self.registry for c in spans.plan.chunks):
            return []
        handed: list[Save] = []

        def key_of(start: int, end: int) -> int:  # (the entry's payload: called for each chunk it stores)
            handed.append(Save(start, end, next(self._keys)))
            return handed[-1].key

        self.namespaces.planner(spans.tenant).register(spans.plan, key_of, lambda n: n * self.bytes_per_token,
                                                       upto=upto)
        # (the budget may refuse some, or evict one stored here to fit a later one)
        return [s for s in handed if s.key in self._fingerprints]

    def evicted(self) -> list[int]:
        out, self._evicted = self._evicted, []
        return out

    def lose(self, keys) -> None:
        """The engine does not hold these keys' rows (a load found none, or a save was skipped): their
        entries leave the registry now, or when the plans that pin them are released."""
        self._lost.update(k for k in keys if not self._discard(k))

    def _discard(self, key: int) -> bool:
        """Evict the entry stored under key; True if it is gone (False: a plan still pins it)."""
        fp = self._fingerprints.get(key)
        return fp is None or self.registry.discard(fp)


def rotate_interleaved(k_pe: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """R(δ)·k_pe for keys whose RoPE pairs are adjacent dims (vLLM's DeepSeek rotary, GPT-J style):
    unit cos/sin, computed in float32 (float64 angles) and rounded once to k_pe's dtype."""
    angles = float(delta) * inv_freq.double()
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    pairs = k_pe.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(k_pe.dtype)
