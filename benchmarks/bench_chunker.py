"""Chunker throughput on one core: target >= 10 M tokens/s (README, Chunker), against the literal
per-token recurrence (``reference_candidates``) measured in the same run.

    python benchmarks/bench_chunker.py [--tokens 10000000] [--reference-tokens 200000]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import numpy as np

from irminsul.kvcache.chunker import ChunkerConfig, boundaries, candidates, chunk, namespace_seed
from irminsul.machine import best_of, describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' slow reference is the baseline
from irminsul.cli import run_for_people
from tests.kvcache.oracles import reference_candidates  # noqa: E402

TARGET = 10e6  # tokens/s: the chunker's throughput target (README, Chunker); 10 ms per 100k-token prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--reference-tokens", type=int, default=200_000)
    ap.add_argument("--vocab", type=int, default=129_280)  # DeepSeek-V2/V3 vocabulary
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):  # one core, as the target says
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    cfg, seed = ChunkerConfig(), namespace_seed("bench")
    tokens = np.random.default_rng(0).integers(0, args.vocab, args.tokens)
    small = tokens[: args.reference_tokens]
    n_chunks = len(chunk(tokens, cfg, seed))
    rows = [
        ("reference_candidates (per-token loop)", len(small), best_of(lambda: reference_candidates(small, cfg), 1)),
        ("candidates (Gear boundary test)", len(tokens), best_of(lambda: candidates(tokens, cfg), args.repeats)),
        ("boundaries (+ clamp to [32, 512])", len(tokens), best_of(lambda: boundaries(tokens, cfg), args.repeats)),
        ("chunk (+ xxh64 fingerprints)", len(tokens), best_of(lambda: chunk(tokens, cfg, seed), args.repeats)),
    ]

    print(f"machine: {describe()} (benchmark pinned to 1 core)")
    print(
        f"python {platform.python_version()}, numpy {np.__version__}; {args.tokens:,} random tokens, "
        f"vocab {args.vocab:,}, {n_chunks:,} chunks (mean {args.tokens / n_chunks:.0f} tokens)"
    )
    base = rows[0][1] / rows[0][2]
    print(f"{'stage':<40} {'tokens':>12} {'seconds':>9} {'M tok/s':>9} {'x reference':>12} {'x target':>9}")
    for name, n, sec in rows:
        rate = n / sec
        print(f"{name:<40} {n:>12,} {sec:>9.3f} {rate / 1e6:>9.2f} {rate / base:>12.1f} {rate / TARGET:>9.2f}")


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
