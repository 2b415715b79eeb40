"""The reuse planner: a request's token ids -> spans of prefix / reuse / compute rows (pure).

Design doc section 3 (the serve path) and Irminsul paper section 3:

1. exact prefix from the radix tree (rows reused as they are);
2. CDC over the *whole* sequence, so boundaries are the content-defined ones the chunks were
   registered with; chunks beyond the prefix are looked up (a chunk straddling the prefix end
   contributes its tail through ``src_offset``), every hit verified by token ids;
3. S1 for chunks that missed: stored 128-token windows at any offset, confirmed by token
   comparison and extended token by token inside both the chunk and the entry;
4. sink carve-out: a row whose target *or* source position is < ``sink`` is computed (the sink is
   tied to the sequence start, measured in the paper for MLA and GQA);
5. the last prompt token is always computed so that its logits exist.

Everything left over is computed in one forward pass at its true positions. The plan is a list
of spans, not a prefix count (docs/design.md section 6). ``plan`` pins every registry entry it uses
and locks its radix match; ``release`` undoes both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from irminsul.kvcache.chunker import Chunk, ChunkerConfig, FingerprintFn, TokenArray, as_tokens, chunk, fingerprint
from irminsul.kvcache.radix import PrefixMatch, PrefixTree, common_prefix
from irminsul.kvcache.registry import Entry, Registry
from irminsul.kvcache.windows import WindowIndex

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PlannerConfig:
    chunker: ChunkerConfig = field(default_factory=ChunkerConfig)
    sink: int = 32  # rows at target or source position < sink are always computed
    window: int = 128  # S1 window length; must equal the WindowIndex's
    content_reuse: bool = True  # False: exact prefix only
    s1: bool = True
    carve_out: bool = True

    def __post_init__(self):
        if self.sink < 0 or self.window < 1:
            raise ValueError(f"need sink >= 0 and window >= 1, got {self.sink}, {self.window}")


@dataclass(frozen=True)
class Span:
    kind: Literal["prefix", "reuse", "compute"]
    start: int  # target positions [start, end)
    end: int
    entry: Entry | None = None  # reuse only
    src_offset: int = 0  # row offset inside entry: rows entry[src_offset : src_offset + len]
    carve_out: bool = False  # compute rows that were found but fall under the sink carve-out

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def delta(self) -> int:
        """RoPE shift for reuse rows: target minus source position (0 for other kinds)."""
        return 0 if self.entry is None else self.start - (self.entry.base_pos + self.src_offset)


@dataclass
class PlanStats:
    prompt_tokens: int = 0  # = prefix_tokens + reused_tokens + computed_tokens
    prefix_tokens: int = 0
    reused_tokens: int = 0  # content-addressed hits beyond the prefix (CDC and S1)
    computed_tokens: int = 0
    carve_out_tokens: int = 0  # subset of computed_tokens
    s1_tokens: int = 0  # subset of reused_tokens
    chunks: int = 0  # CDC chunks looked up (those not inside the prefix)
    chunk_hits: int = 0


@dataclass
class Plan:
    tokens: np.ndarray  # [n] int64
    spans: list[Span]  # sorted, contiguous, covering [0, n)
    stats: PlanStats
    chunks: list[Chunk]  # CDC chunks of the whole sequence (empty without content reuse)
    pinned: list[int]  # fingerprints pinned for this plan (each once)
    prefix: PrefixMatch | None
    released: bool = False

    def compute_positions(self) -> np.ndarray:
        """[n_compute] int64: every target position the forward pass must run."""
        parts = [np.arange(s.start, s.end) for s in self.spans if s.kind == "compute"]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@dataclass(frozen=True)
class Registered:
    entries: int  # new entries stored
    tokens: int
    skipped: int  # chunks whose fingerprint was already present
    rejected: int  # chunks the registry could not fit


_TALLY = {"prefix": "prefix_tokens", "reuse": "reused_tokens", "compute": "computed_tokens"}


@dataclass(frozen=True)
class _Found:
    start: int
    end: int
    entry: Entry
    src_offset: int
    s1: bool


class Planner:
    def __init__(
        self,
        config: PlannerConfig,
        registry: Registry,
        radix: PrefixTree | None,
        windows: WindowIndex | None,
        seed: int,
        *,
        fingerprint_fn: FingerprintFn | None = None,
        fallbacks: Sequence[Planner] = (),
    ):
        if windows is not None and windows.window != config.window:
            raise ValueError(f"WindowIndex.window={windows.window} != PlannerConfig.window={config.window}")
        self.config, self.registry, self.radix, self.windows = config, registry, radix, windows
        self.seed, self.fingerprint_fn = seed, fingerprint_fn
        # Namespaces searched after this one on a miss (a tenant falls back to the operator's shared,
        # published namespace; never to another tenant's).
        self.fallbacks = list(fallbacks)
        if windows is not None:  # keep the window index bounded by the registry's live entries
            self._forget = lambda entry: windows.remove(entry.fingerprint)
            registry.on_evict.append(self._forget)

    def chunk(self, tokens: np.ndarray, segment_starts: TokenArray | None = None) -> list[Chunk]:
        return chunk(tokens, self.config.chunker, self.seed, segment_starts, self.fingerprint_fn)

    def plan(self, tokens: TokenArray, segment_starts: TokenArray | None = None) -> Plan:
        ids = as_tokens(tokens)
        n = len(ids)
        if n == 0:
            raise ValueError("cannot plan an empty prompt")
        prefix: PrefixMatch | None = None
        if self.radix is not None:
            prefix = self.radix.match(ids)
            self.radix.lock(prefix.node)
        matched = prefix.length if prefix is not None else 0
        stats = PlanStats(prompt_tokens=n)
        chunks = self.chunk(ids, segment_starts) if self.config.content_reuse else []
        found: list[_Found] = []
        for c in chunks:
            if c.end <= matched:
                continue
            start = max(c.start, matched)
            stats.chunks += 1
            entry = self.registry.get(c.fingerprint, ids[c.start : c.end])
            for other in self.fallbacks:
                entry = entry or other.lookup(ids[c.start : c.end])
            if entry is not None:
                stats.chunk_hits += 1
                found.append(_Found(start, c.end, entry, start - c.start, False))
            elif self.config.s1:
                found.extend(self._recover(ids, start, c.end))

        pieces = [Span("prefix", 0, min(matched, n - 1))] if matched else []
        for f in found:
            pieces.extend(self._place(f, n, stats))
        spans = _cover(pieces, n)
        pinned = list(dict.fromkeys(s.entry.fingerprint for s in spans if s.entry is not None))  # (the reuse spans)
        for fp in pinned:
            self.registry.pin(fp)
        for s in spans:
            name = _TALLY[s.kind]
            setattr(stats, name, getattr(stats, name) + len(s))
            stats.carve_out_tokens += len(s) if s.carve_out else 0
        return Plan(ids, spans, stats, chunks, pinned, prefix)

    def release(self, plan: Plan) -> None:
        """Unpin the plan's entries and unlock its prefix (idempotent)."""
        if plan.released:
            return
        for fp in plan.pinned:
            self.registry.unpin(fp)
        if plan.prefix is not None:
            assert self.radix is not None, "a plan has a prefix match only from a planner with a tree"
            self.radix.unlock(plan.prefix.node)
        plan.released = True

    def register(
        self,
        plan_or_tokens: Plan | TokenArray,
        rows_of: Callable[[int, int], np.ndarray | torch.Tensor | None],
        nbytes_of: Callable[[int], int],
        segment_starts: TokenArray | None = None,
        upto: int | None = None,
    ) -> Registered:
        """Store every CDC chunk of the sequence that the registry lacks, with base_pos = start.

        ``rows_of(start, end)`` returns the payload for rows [start, end) (None in replay);
        ``nbytes_of(n_tokens)`` its size. A Plan's own chunks are reused when it has them, in which
        case ``segment_starts`` is ignored. With ``upto``, only chunks ending at or before it
        (those whose rows exist while the sequence is still being computed).
        """
        if isinstance(plan_or_tokens, Plan) and plan_or_tokens.chunks:
            ids, chunks = plan_or_tokens.tokens, plan_or_tokens.chunks
        else:
            ids = plan_or_tokens.tokens if isinstance(plan_or_tokens, Plan) else as_tokens(plan_or_tokens)
            chunks = self.chunk(ids, segment_starts)
        entries = tokens = skipped = rejected = 0
        for c in chunks:
            if upto is not None and c.end > upto:
                break  # chunks are in order
            if c.fingerprint in self.registry:
                skipped += 1
                continue
            token_ids = ids[c.start : c.end].copy()
            entry = Entry(c.fingerprint, token_ids, c.start, rows_of(c.start, c.end), nbytes_of(len(c)))
            if not self.registry.put(entry):
                rejected += 1
                continue
            if self.windows is not None:
                self.windows.add(c.fingerprint, token_ids)
            entries, tokens = entries + 1, tokens + len(c)
        return Registered(entries, tokens, skipped, rejected)

    def close(self) -> None:
        """Detach from the registry (the namespace is being dropped); its entries stay stored."""
        if self.windows is not None and self._forget in self.registry.on_evict:
            self.registry.on_evict.remove(self._forget)

    def lookup(self, chunk_ids: np.ndarray) -> Entry | None:
        """This namespace's verified entry for a chunk's token ids, if any."""
        fp = (self.fingerprint_fn or fingerprint)(chunk_ids, self.seed)
        return self.registry.get(fp, chunk_ids)

    def _recover(self, ids: np.ndarray, start: int, end: int) -> list[_Found]:
        """S1: confirmed, extended, non-overlapping window matches inside ids[start:end]."""
        w, out, covered = self.config.window, [], start
        hits = [
            (hit, p.registry)
            for p in (self, *self.fallbacks)
            if p.windows is not None
            for hit in p.windows.candidates(ids, start, end)
        ]
        for hit, registry in sorted(hits, key=lambda h: h[0].query_pos):
            q, off = hit.query_pos, hit.entry_offset
            if q < covered:
                continue
            entry = registry.peek(hit.fingerprint)
            if entry is None or off + w > len(entry.token_ids):
                continue  # stale window: its entry left the registry or was replaced
            src = entry.token_ids
            if not np.array_equal(src[off : off + w], ids[q : q + w]):
                continue  # rolling-hash collision
            back = common_prefix(ids[covered:q][::-1], src[:off][::-1])
            fwd = common_prefix(ids[q + w : end], src[off + w :])
            out.append(_Found(q - back, q + w + fwd, entry, off - back, True))
            covered = q + w + fwd
        return out

    def _place(self, f: _Found, n: int, stats: PlanStats) -> list[Span]:
        """Apply the last-token rule and the sink carve-out to one found run of rows."""
        end = min(f.end, n - 1)  # the last prompt token is always computed (not a carve-out)
        if end <= f.start:
            return []
        cut = f.start
        if self.config.carve_out:  # target and source positions both grow with the row, so the
            source = f.entry.base_pos + f.src_offset  # carved rows are a prefix of the run
            cut = min(end, max(f.start, self.config.sink, f.start + self.config.sink - source))
        spans = [Span("compute", f.start, cut, carve_out=True)] if cut > f.start else []
        if cut < end:
            spans.append(Span("reuse", cut, end, f.entry, f.src_offset + cut - f.start))
            stats.s1_tokens += (end - cut) if f.s1 else 0
        return spans


def _cover(pieces: list[Span], n: int) -> list[Span]:
    """Fill the gaps between sorted, disjoint pieces with compute spans; merge adjacent compute
    spans that share the carve_out flag."""
    out: list[Span] = []
    pos = 0
    for span in pieces + [Span("compute", n, n)]:
        for s in (Span("compute", pos, span.start), span):
            if len(s) == 0:
                continue
            last = out[-1] if out else None
            if last and s.kind == last.kind == "compute" and s.carve_out == last.carve_out:
                out[-1] = replace(last, end=s.end)
            else:
                out.append(s)
        pos = max(pos, span.end)
    return out
