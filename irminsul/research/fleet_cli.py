"""`irminsul bench fleet`: the fleet simulator's table, per routing policy and fleet size."""

from __future__ import annotations

import dataclasses
import json

from irminsul.cli import at_least


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        import argparse

        raise argparse.ArgumentTypeError(f"{text!r}: give fleet sizes as positive integers, e.g. 1,2,4,8")
    return sizes


def _fleet(args) -> int:
    from irminsul.fleet.router import RouterWeights
    from irminsul.research.fleet import POLICIES, FleetConfig, own_sessions, reference, run_fleet
    from irminsul.research.workloads.render import render_trace
    from irminsul.research.workloads.report import pct
    from irminsul.research.workloads.trace import read_trace
    from irminsul.table import table

    policies = args.policies or list(POLICIES)
    unknown = set(policies) - set(POLICIES)
    if unknown:
        from irminsul.errors import UserFacingError

        raise UserFacingError(f"unknown policies {sorted(unknown)}: use {', '.join(POLICIES)}")
    trace = list(render_trace(read_trace(args.trace), args.tokenizer))
    weights = RouterWeights(queued=args.queued_weight, running=args.running_weight)
    if args.queue_slack_tokens is not None:
        weights = dataclasses.replace(weights, queue_slack_tokens=args.queue_slack_tokens)
    config = FleetConfig(pool_tokens=1, offered_load=args.offered_load, weights=weights)
    if args.no_load_bound:
        config = dataclasses.replace(config, bound=None)
    ref = reference(trace, config)
    pool = args.pool_tokens or max(1, ref.distinct_tokens // 2)
    config = dataclasses.replace(config, pool_tokens=pool)
    results = run_fleet(trace, args.replicas, policies, config, ref, progress=True)
    prompt = results[0].prompt_tokens if results else 0
    own = 1 - own_sessions(trace, config) / prompt if prompt else 0.0
    if args.json:
        print(
            json.dumps(
                {
                    "trace": str(args.trace),
                    "pool_tokens": pool,
                    "distinct_tokens": ref.distinct_tokens,
                    "own_session_reuse": own,
                    "offered_load": args.offered_load,
                    "weights": dataclasses.asdict(weights),
                    "load_bound": dataclasses.asdict(config.bound) if config.bound else None,
                    "results": [
                        {
                            **dataclasses.asdict(r),
                            "reuse": r.reuse,
                            "max_share": r.max_share,
                            "max_request_share": r.max_request_share,
                        }
                        for r in results
                    ],
                }
            )
        )
        return 0
    print(
        f"{args.trace}: {len(trace)} requests, {prompt} prompt tokens, {ref.distinct_tokens} distinct "
        f"content tokens; pool {pool} tokens per replica; offered load {args.offered_load}; "
        f"own-session reuse {pct(own)} (each session alone on an unbounded replica)"
    )
    rows = [
        (
            r.replicas,
            r.policy,
            pct(r.reuse),
            r.computed_tokens,
            "-" if r.policy == "perfect" else pct(r.max_share),
            "-" if r.policy == "perfect" else pct(r.max_request_share),
            f"{r.ttft_p50_s:.3f}",
            f"{r.ttft_p95_s:.3f}",
            f"{r.seconds:.1f}",
        )
        for r in results
    ]
    print(
        table(
            (
                "replicas",
                "policy",
                "reuse",
                "computed tokens",
                "busiest work",
                "busiest requests",
                "TTFT p50 s",
                "TTFT p95 s",
                "seconds",
            ),
            rows,
        )
    )
    print("busiest: the busiest replica's share of the work (prompt tokens computed + decoded) and of the requests")
    print(
        f"TTFT: the load model's, queue wait + own prefill at {config.tokens_per_s:,.0f} tokens/s a replica "
        "(perfect: one queue at N x that rate)"
    )
    return 0


def register_bench(bench_subparsers) -> None:
    f = bench_subparsers.add_parser("fleet", help="simulate a fleet of replicas per routing policy, model-free")
    f.add_argument("trace", help="trace JSONL (irminsul workloads build ...)")
    f.add_argument(
        "--replicas",
        type=_sizes,
        default=[1, 2, 4, 8, 16, 32, 64],
        metavar="N,N,...",
        help="fleet sizes (default 1,2,4,8,16,32,64)",
    )
    f.add_argument(
        "--pool-tokens",
        type=at_least(1),
        default=None,
        metavar="N",
        help="each replica's pool in tokens (default: half the trace's distinct content)",
    )
    f.add_argument("--policies", nargs="+", default=None, help="a subset of the policies (default: all)")
    f.add_argument(
        "--offered-load",
        type=float,
        default=0.5,
        help="arrivals keep the fleet this busy at the best reuse (default 0.5)",
    )
    f.add_argument("--queued-weight", type=float, default=1.0, help="the content router's queued weight")
    f.add_argument("--running-weight", type=float, default=32.0, help="the content router's running weight")
    f.add_argument(
        "--queue-slack-tokens",
        type=at_least(0),
        default=None,
        metavar="N",
        help="the content router's queue slack: a queue within min(reuse, N) tokens of the shortest does not "
        "count (default: RouterWeights'; 0: every queued token counts)",
    )
    f.add_argument("--no-load-bound", action="store_true", help="the content router without its work-share bound")
    f.add_argument("--tokenizer", default="deepseek", help="deepseek (default), qwen2 or a tokenizer directory")
    f.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    f.set_defaults(func=_fleet)
