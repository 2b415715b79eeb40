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
- `SpanIndex.lose(keys)` -> the engine lacks these rows after all: their entries are never planned again;
- with store tiers below the registry (tiers.py: Irminsul's disk and Redis tiers): `SpanIndex.fetched()`
  -> rows a plan found in a lower tier, each under the new key its entry got in memory, which the engine
  must take in; `SpanIndex.spill(key, rows)` -> the rows the engine copied out under a key, written down
  to the lower tiers in the background.

Rows pass through here only on their way to or from a lower tier: the engine's worker holds them
(see `connector.py`), under a key that
each registration of a chunk gets anew (the entry's payload). A chunk evicted and registered again
gets a new key, so a drop of its old rows can never remove the new ones, in whatever step either
reaches the worker. Tenants are Irminsul's namespaces (`irminsul/kvcache/namespaces.py`): each
searches its own entries, then the operator's `SHARED` ones. Nothing here imports an engine.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from irminsul.integrations.vllm.tiers import ConnectorTiers
from irminsul.kvcache.chunker import ChunkerConfig
from irminsul.kvcache.journal import ChunkJournal
from irminsul.kvcache.namespaces import Namespaces
from irminsul.kvcache.planner import Plan, Planner, PlannerConfig
from irminsul.kvcache.radix import RadixCache
from irminsul.kvcache.registry import ChunkStore, Entry, MemoryRegistry

KEEP_UNSPILLED = 4096  # saves whose rows have not come back from the engine yet (each comes back in its step)


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
    """The content index (chunker, registry, S1 windows, planner per tenant) for an engine.

    `registry`: the chunk store (tiers.py's, over disk and Redis tiers); a memory registry of
    `budget_bytes` by default. Its memory tier's entries name the engine's keys."""

    def __init__(
        self,
        model_id: str,
        bytes_per_token: int,
        budget_bytes: int,
        tenant: str = "",
        sink: int = 32,
        chunker: ChunkerConfig | None = None,
        max_namespaces: int = 1024,
        registry: ChunkStore | None = None,
    ):
        self.bytes_per_token = bytes_per_token
        self.registry: ChunkStore = registry if registry is not None else MemoryRegistry(budget_bytes)
        self.tiered = bool(self.registry.lower)
        config = PlannerConfig(chunker=chunker or ChunkerConfig(), sink=sink)
        # NOTE: the engine's own prefix cache serves exact prefixes, so the namespaces' radix tree
        # stays empty (every plan's prefix match is 0 tokens)
        self.namespaces = Namespaces(config, self.registry, RadixCache(0, 1), model_id, tenant, max_namespaces)
        self._keys = itertools.count()
        self._fingerprints: dict[int, int] = {}  # key -> fingerprint, of the entries stored
        self._evicted: list[int] = []
        self._lost: set[int] = set()  # keys whose rows the engine lacks, still pinned by a plan
        self._fetched: dict[int, torch.Tensor] = {}  # key -> rows a lower tier gave, for the engine to take in
        self._unspilled: OrderedDict[int, Entry] = OrderedDict()  # key -> its entry, until its rows come back
        self.fetched_tokens = 0  # rows brought in from the lower tiers, all plans together
        self._promoted: list[int] = []  # fingerprints the plan under way brought in (pinned until it ends)
        self.registry.on_store.append(lambda entry: self._fingerprints.__setitem__(entry.payload, entry.fingerprint))
        self.registry.on_evict.append(self._on_evict)
        # the chunks the memory tier holds, for a fleet router to follow (journal.py serves it), wired as
        # Irminsul's own cache wires its journal (kvcache/caches.py)
        self.journal = ChunkJournal()
        self.registry.on_store.append(lambda entry: self.journal.added(entry.fingerprint))
        self.registry.on_evict.append(lambda entry: self.journal.removed(entry.fingerprint))
        self.registry.bind(self._promote, lambda entry: entry)

    @property
    def naming(self) -> dict:
        """What a router needs to fingerprint chunks as this index does (`ContentRouter`'s arguments)."""
        config = self.namespaces.config
        marker = config.chunker.marker
        return {
            "model_id": self.namespaces.model_id,
            "default_tenant": self.namespaces.default_tenant,
            "marker": list(marker) if marker else None,
            "sink": config.sink,
        }

    def _on_evict(self, entry) -> None:
        self._fingerprints.pop(entry.payload, None)
        self._fetched.pop(entry.payload, None)  # (never handed over: the drop that follows frees nothing)
        self._evicted.append(entry.payload)

    def _promote(self, found: Entry) -> Entry | None:
        """A lower tier's verified entry (its payload the rows) into memory under a new key; its rows
        wait in `fetched` for the engine. None (a miss) when the budget has no room."""
        rows = found.payload
        assert isinstance(rows, torch.Tensor), f"entry {found.fingerprint:#x} from a lower tier holds no rows"
        key = next(self._keys)
        entry = dataclasses.replace(found, payload=key, nbytes=len(found) * self.bytes_per_token)
        if not self.registry.memory.put(entry):
            return None
        # NOTE: pinned until the plan ends (plan() unpins, the planner having pinned what it uses): a
        # later chunk of the same plan brought in must not evict it before the plan names it
        self.registry.memory.pin(entry.fingerprint)
        self._promoted.append(entry.fingerprint)
        self._fetched[key] = rows
        self.fetched_tokens += len(found)
        return entry

    def plan(self, token_ids, tenant: str | None = None) -> RequestSpans:
        planner = self.namespaces.planner(tenant)
        try:
            plan = planner.plan(np.asarray(token_ids, dtype=np.int64))
        finally:
            for fp in self._promoted:
                self.registry.memory.unpin(fp)
            self._promoted.clear()
        # (an entry no longer stored is never loaded: its rows are being dropped)
        loads = [
            Load(s.start, s.end, s.entry.payload, s.src_offset, s.delta)
            for s in plan.spans
            if s.kind == "reuse" and s.entry.payload not in self._lost and s.entry.payload in self._fingerprints
        ]
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

        self.namespaces.planner(spans.tenant).register(
            spans.plan, key_of, lambda n: n * self.bytes_per_token, upto=upto
        )
        # (the budget may refuse some, or evict one stored here to fit a later one)
        saves = [s for s in handed if s.key in self._fingerprints]
        if self.tiered:  # each entry as it will go down to the lower tiers, once the engine has its rows
            for s in saves:
                entry = self.registry.memory.peek(self._fingerprints[s.key])
                if entry is not None:
                    self._unspilled[s.key] = entry
            while len(self._unspilled) > KEEP_UNSPILLED:
                self._unspilled.popitem(last=False)
        return saves

    def fetched(self) -> dict[int, torch.Tensor]:
        """Rows found in a lower tier since the last call, by the key their entry got in memory."""
        out, self._fetched = self._fetched, {}
        return out

    def spill(self, key: int, rows: torch.Tensor) -> bool:
        """The engine copied out the rows saved under `key` ([layers, len, row width]): they go down to
        the lower tiers, on the store's writer thread. False when no save under that key waits."""
        entry = self._unspilled.pop(key, None)
        if entry is None:
            return False
        assert isinstance(self.registry, ConnectorTiers)
        self.registry.spill(dataclasses.replace(entry, payload=rows, nbytes=rows.numel() * rows.element_size()))
        return True

    def evicted(self) -> list[int]:
        out, self._evicted = self._evicted, []
        return out

    def lose(self, keys) -> None:
        """The engine does not hold these keys' rows (a load found none, or a save was skipped): their
        entries leave the registry now, or when the plans that pin them are released."""
        keys = list(keys)
        for key in keys:
            self._unspilled.pop(key, None)
        self._lost.update(k for k in keys if not self._discard(k))

    def _discard(self, key: int) -> bool:
        """Evict the entry stored under key; True if it is gone (False: a plan still pins it)."""
        fp = self._fingerprints.get(key)
        return fp is None or self.registry.memory.discard(fp)

    def close(self) -> None:
        """Write down what is queued for the lower tiers and stop their threads (nothing without tiers)."""
        if self.tiered:
            self.registry.close()


def rotate_interleaved(k_pe: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """R(δ)·k_pe for keys whose RoPE pairs are adjacent dims (vLLM's DeepSeek rotary, GPT-J style):
    unit cos/sin, computed in float32 (float64 angles) and rounded once to k_pe's dtype."""
    angles = float(delta) * inv_freq.double()
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    pairs = k_pe.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(k_pe.dtype)
