"""The recovery benchmark: replay a trace through the planner with a persistent cache and count,
per strategy, the tokens served beyond the exact prefix (paper §5, "Irminsul adds").

Strategies:
- `prefix`   exact prefix only (SGLang/vLLM behaviour; the planner with content_reuse=False);
- `fixed128` position-independent hashing of absolute-offset-aligned 128-token blocks: a block
             hits when the same content was seen before at any aligned offset (what aligned-page
             PIC schemes, SGLang/LMCache-style, would find); own small implementation;
- `cdc`      the planner's content-defined chunks, no S1, no segments;
- `cdc+s1`   plus S1 window recovery inside missed chunks;
- `cdc+s2`   plus the trace's segment starts (S2), S1 kept on.
Each replay mimics the engine after every request: plan, register the sequence's chunks, insert
it into the prefix tree (payloads are None: no model). The budget is unbounded unless given. All
strategies apply the same sink carve-out and last-token rule, so they are compared like for like.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import xxhash

from irminsul.kvcache.chunker import ChunkerConfig, namespace_seed
from irminsul.kvcache.planner import Planner, PlannerConfig
from irminsul.kvcache.radix import RadixCache
from irminsul.kvcache.registry import MemoryRegistry
from irminsul.kvcache.windows import WindowIndex
from irminsul.research.workloads.census import CensusConfig, CensusResult, run_census
from irminsul.research.workloads.prefix import PrefixIndex
from irminsul.research.workloads.render import Rendered

STRATEGIES = ("prefix", "fixed128", "cdc", "cdc+s1", "cdc+s2")
BYTES_PER_TOKEN = 31_104  # DeepSeek-V2-Lite, bf16: 27 layers x 576 x 2 B (design §2)


@dataclass(frozen=True)
class RecoveryConfig:
    chunker: ChunkerConfig = field(default_factory=ChunkerConfig)
    sink: int = 32
    window: int = 128  # S1 window
    block: int = 128  # fixed-block baseline
    budget_bytes: int = 1 << 62  # effectively unbounded: measures what is findable, not evictions
    bytes_per_token: int = BYTES_PER_TOKEN
    model_id: str = "replay"

    def __post_init__(self):
        assert self.block > 0 and self.window > 0 and self.sink >= 0 and self.budget_bytes >= 0


@dataclass(frozen=True)
class StrategyResult:
    name: str
    prompt_tokens: int
    prefix_tokens: int
    recovered_tokens: int  # served beyond the exact prefix
    computed_tokens: int
    carve_out_tokens: int
    s1_tokens: int
    seconds: float
    stored_tokens: int = 0  # tokens held by the content-addressed store at the end (not the prefix tree)


@dataclass(frozen=True)
class RecoveryResult:
    requests: int
    prompt_tokens: int
    prefix_tokens: int  # exact prefix (the `prefix` strategy's, else the census's)
    oracle_tokens: int  # the census oracle: prefix + shifted content outside the sink
    strategies: dict[str, StrategyResult]

    def of_oracle(self, s: StrategyResult) -> float:
        """Tokens served (prefix + recovered) as a fraction of the oracle."""
        return (s.prefix_tokens + s.recovered_tokens) / self.oracle_tokens if self.oracle_tokens else 0.0

    def of_oracle_beyond_prefix(self, s: StrategyResult) -> float:
        beyond = self.oracle_tokens - s.prefix_tokens
        return s.recovered_tokens / beyond if beyond > 0 else 0.0

    def to_json(self) -> dict:
        out = {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "prefix_tokens": self.prefix_tokens,
            "oracle_tokens": self.oracle_tokens,
            "strategies": {},
        }
        for name, s in self.strategies.items():
            out["strategies"][name] = {
                **{k: v for k, v in asdict(s).items() if k != "name"},
                "recovered_fraction": s.recovered_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "of_oracle": self.of_oracle(s),
                "of_oracle_beyond_prefix": self.of_oracle_beyond_prefix(s),
                "tokens_per_s": self.prompt_tokens / s.seconds if s.seconds else None,
            }
        st = self.strategies
        if "cdc+s1" in st and "fixed128" in st:
            fixed = st["fixed128"].recovered_tokens
            out["cdc_s1_over_fixed128"] = st["cdc+s1"].recovered_tokens / fixed if fixed else None
        return out


def replay_planner(
    trace: Sequence[tuple[str, Rendered]], name: str, config: RecoveryConfig = RecoveryConfig(), progress: bool = False
) -> StrategyResult:
    """Replay through the real planner; `name` is one of prefix, cdc, cdc+s1, cdc+s2."""
    from tqdm import tqdm

    content, s1, s2 = name != "prefix", name in ("cdc+s1", "cdc+s2"), name == "cdc+s2"
    registry = MemoryRegistry(config.budget_bytes)
    radix = RadixCache(config.budget_bytes, config.bytes_per_token)
    windows = WindowIndex(config.window) if s1 else None
    planner = Planner(
        PlannerConfig(
            chunker=config.chunker, sink=config.sink, window=config.window, content_reuse=content, s1=s1, carve_out=True
        ),
        registry,
        radix,
        windows,
        seed=namespace_seed(config.model_id),
    )
    totals = dict.fromkeys(
        ("prompt_tokens", "prefix_tokens", "reused_tokens", "computed_tokens", "carve_out_tokens", "s1_tokens"), 0
    )
    start = time.perf_counter()
    for _, r in tqdm(trace, desc=name, disable=not progress, leave=False):
        tokens = r.token_ids.astype(np.int64)
        segments = r.segment_starts if s2 else None
        plan = planner.plan(tokens, segments)
        for k in totals:
            totals[k] += getattr(plan.stats, k)
        if content:  # the engine registers every chunk after the request (payload None: no model)
            planner.register(
                plan, rows_of=lambda a, b: None, nbytes_of=lambda k: k * config.bytes_per_token, segment_starts=segments
            )
        radix.insert(tokens, None)
        planner.release(plan)
    return StrategyResult(
        name,
        totals["prompt_tokens"],
        totals["prefix_tokens"],
        totals["reused_tokens"],
        totals["computed_tokens"],
        totals["carve_out_tokens"],
        totals["s1_tokens"],
        time.perf_counter() - start,
        registry.stats.bytes // config.bytes_per_token,
    )


def replay_fixed_blocks(
    trace: Sequence[tuple[str, Rendered]], config: RecoveryConfig = RecoveryConfig(), name: str = "fixed128"
) -> StrategyResult:
    """Aligned fixed blocks keyed by content alone (xxh3-128), each stored once with the offset it
    was first seen at; LRU under the same byte budget as the planner's registry."""
    b, sink = config.block, config.sink
    capacity = config.budget_bytes // (b * config.bytes_per_token)  # blocks
    prefix_index, first_seen = PrefixIndex(), OrderedDict()
    prompt = prefix_total = recovered = carved = 0
    start = time.perf_counter()
    for _, r in trace:
        tokens = np.ascontiguousarray(r.token_ids, dtype=np.int32)
        n = len(tokens)
        prefix = min(prefix_index.add(tokens), n - 1)  # the last prompt token is always computed
        data = memoryview(tokens.tobytes())
        keys = [xxhash.xxh3_128_intdigest(data[4 * s : 4 * (s + b)]) for s in range(0, n - b + 1, b)]
        for k, key in enumerate(keys):
            s, e = k * b, min((k + 1) * b, n - 1)
            src = first_seen.get(key)
            if src is None or e <= prefix:
                continue
            first_seen.move_to_end(key)
            cut = min(e, max(s, sink, s + sink - src))  # sink carve-out on target or source rows
            lo = max(prefix, s)
            recovered += max(0, e - max(cut, lo))
            carved += max(0, min(cut, e) - lo)
        for k, key in enumerate(keys):
            if capacity and key not in first_seen:
                first_seen[key] = k * b
                if len(first_seen) > capacity:
                    first_seen.popitem(last=False)
        prompt, prefix_total = prompt + n, prefix_total + prefix
    computed = prompt - prefix_total - recovered
    return StrategyResult(
        name, prompt, prefix_total, recovered, computed, carved, 0, time.perf_counter() - start, len(first_seen) * b
    )


def run_recovery(
    trace: Iterable[tuple[str, Rendered]],
    strategies: Sequence[str] = STRATEGIES,
    config: RecoveryConfig = RecoveryConfig(),
    progress: bool | None = None,
    census: CensusResult | None = None,
) -> RecoveryResult:
    """Replay `trace` once per strategy; the oracle comes from `census` (run here when not given)."""
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:  # NOTE: before the trace is consumed, which renders it
        from irminsul.errors import UserFacingError

        raise UserFacingError(f"unknown strategies {sorted(unknown)}: use {', '.join(STRATEGIES)}")
    trace = list(trace)
    show = len(trace) >= 200 if progress is None else progress
    if census is None:
        census = run_census(((s, r.token_ids) for s, r in trace), CensusConfig(sink=config.sink))
    results = {}
    for name in strategies:
        results[name] = (
            replay_fixed_blocks(trace, config)
            if name == "fixed128"
            else replay_planner(trace, name, config, progress=show)
        )
    prefix = results["prefix"].prefix_tokens if "prefix" in results else census.prefix_tokens
    return RecoveryResult(len(trace), census.prompt_tokens, prefix, census.oracle_tokens, results)
