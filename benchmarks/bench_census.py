"""Census + recovery over the shared data: tables and throughput (target: under a minute in all).

Builds every source (and, with --patterns, every applicable pattern), renders it with the named
tokenizer, runs the census and replays the recovery strategies, and prints the machine, the
tables (Markdown) and tokens/s per stage. The CLI runs the same code one trace at a time:

    irminsul workloads build PATTERN --source SOURCE --out T.jsonl
    irminsul census T.jsonl --json && irminsul bench recovery T.jsonl --json

    python benchmarks/bench_census.py                       # raw sources: the one-minute target
    python benchmarks/bench_census.py --patterns all        # every source x pattern (docs tables)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from irminsul.cli import run_for_people
from irminsul.errors import UserFacingError
from irminsul.machine import describe
from irminsul.research.workloads.builders import SOURCES, build_source
from irminsul.research.workloads.census import run_census
from irminsul.research.workloads.patterns import PATTERNS, apply_pattern
from irminsul.research.workloads.recovery import STRATEGIES, run_recovery
from irminsul.research.workloads.render import render_trace
from irminsul.research.workloads.report import pct
from irminsul.table import table

TARGET_SECONDS = 60.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--patterns", default="raw", help="comma-separated, or 'all'")
    ap.add_argument("--tokenizer", default="deepseek")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=None, help="first N sessions of each source")
    args = ap.parse_args()
    patterns = list(PATTERNS) if args.patterns == "all" else args.patterns.split(",")

    census_rows, recovery_rows, timing = [], [], {"render": 0.0, "census": 0.0, "recovery": 0.0}
    total_tokens, wall = 0, time.perf_counter()
    for source in args.sources.split(","):
        base = build_source(source, n=args.n)
        for pattern in patterns:
            try:
                requests = apply_pattern(pattern, base, seed=args.seed)
            except UserFacingError as e:
                print(f"skip {source} x {pattern}: {e}")
                continue
            t = time.perf_counter()
            trace = list(render_trace(requests, args.tokenizer, progress=False))
            t1 = time.perf_counter()
            census = run_census((s, r.token_ids) for s, r in trace)
            t2 = time.perf_counter()
            rec = run_recovery(trace, census=census, progress=False)
            t3 = time.perf_counter()
            for k, dt in zip(timing, (t1 - t, t2 - t1, t3 - t2)):
                timing[k] += dt
            total_tokens += census.prompt_tokens
            f = census.fraction
            census_rows.append(
                (
                    f"{source} / {pattern}",
                    census.requests,
                    census.sessions,
                    f"{census.prompt_tokens:,}",
                    pct(f(census.prefix_tokens)),
                    pct(f(census.shifted_tokens)),
                    pct(f(census.within_session_shifted)),
                    pct(f(census.cross_session_shifted)),
                    pct(f(census.novel_tokens)),
                    pct(f(census.oracle_tokens)),
                )
            )
            st = rec.strategies
            fixed = st["fixed128"].recovered_tokens
            recovery_rows.append(
                (
                    f"{source} / {pattern}",
                    pct(rec.prefix_tokens / rec.prompt_tokens),
                    *(pct(st[s].recovered_tokens / rec.prompt_tokens) for s in STRATEGIES[1:]),
                    pct(rec.of_oracle(st["cdc+s1"])),
                    pct(rec.of_oracle(st["cdc+s2"])),
                    f"{st['cdc+s1'].recovered_tokens / fixed:.1f}x" if fixed else "n/a",
                )
            )
    wall = time.perf_counter() - wall

    print(f"machine: {describe()}")
    print(f"tokenizer {args.tokenizer}, seed {args.seed}\n\ncensus (share of prompt tokens):\n")
    print(
        table(
            (
                "trace",
                "requests",
                "sessions",
                "prompt tokens",
                "prefix",
                "shifted",
                "within",
                "cross",
                "novel",
                "oracle",
            ),
            census_rows,
        )
    )
    print("\nrecovery (exact prefix, then tokens served beyond it, as shares of prompt tokens):\n")
    print(
        table(
            ("trace", "prefix", "fixed128", "cdc", "cdc+s1", "cdc+s2", "s1 of oracle", "s2 of oracle", "s1 / fixed128"),
            recovery_rows,
        )
    )
    print(
        f"\n{total_tokens:,} prompt tokens; "
        + ", ".join(f"{k} {v:.1f}s ({total_tokens / v / 1e6:.2f} M tok/s)" for k, v in timing.items())
        + f" (recovery: {len(STRATEGIES)} replays)"
    )
    print(
        f"wall {wall:.1f}s (build + render + census + recovery) vs target {TARGET_SECONDS:.0f}s: "
        f"{'met' if wall < TARGET_SECONDS else 'NOT met'}; "
        f"end to end {total_tokens / wall / 1e6:.2f} M tok/s"
    )


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
