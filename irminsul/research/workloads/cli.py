"""`irminsul workloads build`, `irminsul census` and `irminsul bench recovery`."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from irminsul.cli import at_least
from irminsul.errors import UserFacingError


def _build(args) -> int:
    from pathlib import Path

    from irminsul.research.workloads.builders import build_source
    from irminsul.research.workloads.patterns import apply_pattern
    from irminsul.research.workloads.trace import write_trace

    folder = Path(args.out).parent
    if not folder.is_dir():  # (checked before the trace is built, which can take a while)
        raise UserFacingError(f"--out {args.out}: the folder {folder} does not exist")

    requests = apply_pattern(args.pattern, build_source(args.source, args.data, args.n), seed=args.seed)
    dropped = ""
    if args.max_prompt_tokens is not None:
        # each session up to its first turn over the limit (its later turns build on that one)
        from irminsul.research.workloads.render import render_trace

        over: set[str] = set()
        kept = []
        for request, (session, rendered) in zip(requests, render_trace(requests, args.tokenizer, desc="measure")):
            if session not in over and len(rendered.token_ids) > args.max_prompt_tokens:
                over.add(session)
            if session not in over:
                kept.append(request)
        dropped = (
            f"; dropped {len(requests) - len(kept)} requests: {len(over)} sessions cut at their first prompt "
            f"over {args.max_prompt_tokens} tokens ({args.tokenizer} tokenizer)"
        )
        requests = kept
    if not requests:
        raise UserFacingError(
            f"{args.pattern} from {args.source} built no requests"
            f"{f' from the first {args.n} sessions' if args.n is not None else ''}{dropped}; "
            f"nothing written"
        )
    n = write_trace(args.out, requests)
    print(
        f"wrote {n} requests in {len(Counter(r.session for r in requests))} sessions "
        f"({args.pattern} from {args.source}, seed {args.seed}) to {args.out}{dropped}"
    )
    return 0


def _census(args) -> int:
    from irminsul.research.workloads.census import CensusConfig, run_census
    from irminsul.research.workloads.render import render_trace
    from irminsul.research.workloads.report import pct
    from irminsul.research.workloads.trace import read_trace
    from irminsul.table import table

    rendered = render_trace(read_trace(args.trace), args.tokenizer, desc="census")
    result = run_census(((s, r.token_ids) for s, r in rendered), CensusConfig(window=args.window))
    if args.plot:
        _census_plot(result, args.plot, Path(args.trace).name)
        _wrote(args.plot)
    if args.json:
        print(json.dumps({"trace": str(args.trace), "tokenizer": args.tokenizer, **result.to_json()}))
        return 0
    f = result.fraction
    rows = [
        ("prefix", result.prefix_tokens, pct(f(result.prefix_tokens))),
        ("shifted", result.shifted_tokens, pct(f(result.shifted_tokens))),
        ("  within session", result.within_session_shifted, pct(f(result.within_session_shifted))),
        ("  cross session", result.cross_session_shifted, pct(f(result.cross_session_shifted))),
        ("novel", result.novel_tokens, pct(f(result.novel_tokens))),
        ("oracle (PIC bound)", result.oracle_tokens, pct(f(result.oracle_tokens))),
        ("prompt", result.prompt_tokens, "100.0%"),
    ]
    print(f"{args.trace}: {result.requests} requests, {result.sessions} sessions, tokenizer {args.tokenizer}")
    print(table(("class", "tokens", "share"), rows))
    return 0


def _census_plot(result, path, title) -> None:
    from irminsul.research.workloads.report import bar_chart

    rows = result.per_request
    groups = max(1, min(40, len(rows)))
    bounds = [round(i * len(rows) / groups) for i in range(groups + 1)]
    series = {k: [] for k in ("prefix", "shifted within session", "shifted cross session", "novel")}
    for a, b in zip(bounds, bounds[1:]):
        chunk = rows[a:b]
        total = max(1, sum(r.prompt_tokens for r in chunk))
        for key, attr in zip(series, ("prefix_tokens", "within_tokens", "cross_tokens", "novel_tokens")):
            series[key].append(sum(getattr(r, attr) for r in chunk) / total)
    labels = [str(a) if i % max(1, groups // 8) == 0 else "" for i, a in enumerate(bounds[:-1])]
    bar_chart(path, labels, series, f"census: {title}", "share of prompt tokens (by request)", stacked=True)


def _recovery(args) -> int:
    from irminsul.research.workloads.recovery import STRATEGIES, RecoveryConfig, run_recovery
    from irminsul.research.workloads.render import render_trace
    from irminsul.research.workloads.report import bar_chart, pct
    from irminsul.research.workloads.trace import read_trace
    from irminsul.table import table

    rendered = render_trace(read_trace(args.trace), args.tokenizer)  # rendered once the strategies are checked
    config = RecoveryConfig() if args.budget_gib is None else RecoveryConfig(budget_bytes=int(args.budget_gib * 2**30))
    result = run_recovery(rendered, strategies=args.strategies or STRATEGIES, config=config, progress=None)
    if args.plot:
        names = list(result.strategies)
        bar_chart(
            args.plot,
            names,
            {
                "prefix": [result.prefix_tokens / result.prompt_tokens] * len(names),
                "recovered beyond prefix": [
                    s.recovered_tokens / result.prompt_tokens for s in result.strategies.values()
                ],
            },
            f"recovery: {Path(args.trace).name}",
            "share of prompt tokens",
            stacked=True,
            hline=("census oracle", result.oracle_tokens / result.prompt_tokens),
        )
        _wrote(args.plot)
    if args.json:
        print(json.dumps({"trace": str(args.trace), "tokenizer": args.tokenizer, **result.to_json()}))
        return 0
    print(
        f"{args.trace}: {result.requests} requests, {result.prompt_tokens} prompt tokens, "
        f"exact prefix {pct(result.prefix_tokens / result.prompt_tokens)}, "
        f"oracle {pct(result.oracle_tokens / result.prompt_tokens)}"
    )
    rows = [
        (
            name,
            s.recovered_tokens,
            pct(s.recovered_tokens / result.prompt_tokens),
            pct(result.of_oracle(s)),
            s.stored_tokens,
            f"{s.seconds:.2f}",
        )
        for name, s in result.strategies.items()
    ]
    print(table(("strategy", "recovered beyond prefix", "of prompt", "of oracle", "stored tokens", "seconds"), rows))
    return 0


def _wrote(path) -> None:
    print(f"wrote {path}", file=sys.stderr)  # stderr: --json keeps stdout one JSON object


def _add_tokenizer(p) -> None:
    p.add_argument("--tokenizer", default="deepseek", help="deepseek (default), qwen2 or a tokenizer directory")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="FILE", help="write a PNG chart")


def register(subparsers) -> None:
    from irminsul.research.workloads.builders import SOURCES
    from irminsul.research.workloads.patterns import PATTERNS

    w = subparsers.add_parser("workloads", help="build agentic workload traces from real data")
    wsub = w.add_subparsers(dest="workloads_command", required=True)
    b = wsub.add_parser("build", help="build a trace: a pattern applied to a source")
    b.add_argument("pattern", choices=sorted(PATTERNS), help="the agent pattern applied to each session")
    b.add_argument("--source", required=True, choices=sorted(SOURCES), help="the data the sessions come from")
    b.add_argument("--out", required=True, help="the JSONL trace to write")
    b.add_argument("--n", type=at_least(1), default=None, help="keep the first N sessions of the source")
    b.add_argument("--seed", type=int, default=0, help="seed of the pattern's random choices")
    b.add_argument("--data", default=None, help="data folder (default: the one shipped in irminsul/data)")
    b.add_argument(
        "--max-prompt-tokens",
        type=at_least(1),
        default=None,
        metavar="N",
        help="cut each session before its first prompt longer than N tokens, as `census` renders it "
        "with --tokenizer (a server's own chat template may count fewer): a trace a model with a "
        "context of N + its output serves whole (the bundled model: 2048)",
    )
    b.add_argument("--tokenizer", default="deepseek", help="deepseek (default), qwen2 or a tokenizer directory")
    b.set_defaults(func=_build)

    c = subparsers.add_parser("census", help="class a trace's tokens as prefix / shifted / novel")
    c.add_argument("trace", help="trace JSONL (irminsul workloads build ...)")
    c.add_argument("--window", type=int, default=64, help="fingerprint window in tokens (default 64)")
    _add_tokenizer(c)
    c.set_defaults(func=_census)


def register_bench(bench_subparsers) -> None:
    from irminsul.research.fleet_cli import register_bench as fleet_bench

    r = bench_subparsers.add_parser("recovery", help="replay a trace through the planner, per strategy")
    r.add_argument("trace", help="trace JSONL (irminsul workloads build ...)")
    r.add_argument("--strategies", nargs="+", default=None, help="a subset of the strategies")
    r.add_argument(
        "--budget-gib",
        type=float,
        default=None,
        help="content store budget per strategy in GiB at 31,104 B/token (default: unbounded)",
    )
    _add_tokenizer(r)
    r.set_defaults(func=_recovery)
    fleet_bench(bench_subparsers)
