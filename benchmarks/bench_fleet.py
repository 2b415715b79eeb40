"""Fleet benchmark: two replicas on Ray Serve, the content router against Ray Serve's own routers.

    python benchmarks/bench_fleet.py [--requests 150] [--concurrency 4] [--routers ...] [--model DIR] [--skip-sim]

For each trace (agent_meta from tau_bench; rerank and skewed from musique; each cut to its first `--requests`),
and each router (`content`; Ray Serve LLM's `PrefixCacheAffinityRouter` as `prefix`,
`irminsul/fleet/prefix_router.py`; Serve's default power of two as `pow2`), a fresh fleet starts
(`irminsul/fleet/serve.py`, one thread a replica, every pool empty, no shared store) and the trace is
replayed by `irminsul bench serve`'s client. Each replica's pool holds half the trace's distinct content
(the simulator's `reference`: the content tokens one unbounded replica ends up holding). `perfect` is
perfect routing, measured: the same path with ONE replica whose pool holds the whole fleet's
(replicas x the rows), fresh, the same client. The figures: TTFT p50/p95, throughput, the prompt tokens
the fleet computed (every replica's `irminsul_computed_tokens_total`, from the fleet's /metrics), each
replica's computed tokens and requests (`irminsul_requests_total`), and the busiest replica's share of
the work (computed prompt tokens + generated tokens, `irminsul_generation_tokens_total`); then the
targets (gap to perfect closed, TTFT p50 against prefix, work share), and the simulator's table
(`irminsul bench fleet`, same code) on the same requests for N = 2 ... 64.

The model is `benchmarks/bench_serve.py`'s, a tiny random DeepSeek-V2 with Qwen2's tokenizer and a 64k
context (agent_meta prompts are 4-12 k tokens; its quality is irrelevant to TTFT and reuse), rendering
with the Qwen2.5-like format the simulator renders with (`fleet_model`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from irminsul.cli import main as irminsul
from irminsul.cli import run_for_people
from irminsul.errors import UserFacingError
from irminsul.machine import describe
from irminsul.research.bench_serve import BenchResult, replay, summarise
from irminsul.research.fleet import FleetConfig as SimConfig
from irminsul.research.fleet import reference
from irminsul.research.workloads.render import render_trace
from irminsul.research.workloads.trace import read_trace
from irminsul.table import table

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import default_model  # noqa: E402

TRACES = {"agent_meta": "tau_bench", "rerank": "musique", "skewed": "musique"}
ROUTERS = ("content", "prefix", "pow2", "perfect")  # perfect: one replica with the fleet's whole pool
TOKENIZER = "qwen2"  # the model's: the trace's distinct content counted in its tokens


@dataclass(frozen=True)
class Run:
    router: str
    result: BenchResult
    per_replica: tuple[tuple[int, int, int], ...]  # (computed, generated, requests) a replica, most work first

    @property
    def computed_tokens(self) -> int:
        return sum(c for c, _, _ in self.per_replica)

    @property
    def max_share(self) -> float:
        """The busiest replica's share of the work: prompt tokens computed plus tokens generated."""
        work = [c + g for c, g, _ in self.per_replica]
        return work[0] / max(1, sum(work))


def fleet_model() -> Path:
    """bench_serve.py's tiny checkpoint without its Jinja `chat_template` (Qwen2's plain template, which
    renders the first system message only and no tools), so replicas render with the hand-written
    Qwen2.5-like format: token-identical to the simulator's `render_trace(..., "qwen2")`."""
    src = default_model()
    dst = src.with_name(src.name + "-fleet")
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.name != "tokenizer_config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return dst


COUNTERS = ("irminsul_computed_tokens_total", "irminsul_generation_tokens_total", "irminsul_requests_total")


def fleet_counters(url: str) -> tuple[tuple[int, int, int], ...]:
    """(prompt tokens computed, tokens generated, requests finished) each replica, most work first, from the
    fleet's /metrics (each sample labelled with its replica)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(COUNTERS))
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=60).text):
        for s in family.samples:
            if s.name in COUNTERS:
                counts[s.labels["replica"]][COUNTERS.index(s.name)] += s.value
    rows = (tuple(int(v) for v in c) for c in counts.values())
    return tuple(sorted(rows, key=lambda r: r[0] + r[1], reverse=True))  # type: ignore[arg-type]


def run_fleet(
    router: str, requests, model: Path, kv_cache_gib: float, replicas: int, concurrency: int, max_tokens: int
) -> Run:
    import httpx
    import ray
    from ray import serve

    from irminsul.fleet.serve import FleetConfig, build
    from irminsul.server.config import ServerConfig
    from tests.support.services import free_port, wait_for

    env = {"OMP_NUM_THREADS": "1", "IRMINSUL_COMPILE_DECODE": "0"}
    # one CPU a replica, and one for Ray's prefix tree actor (the ingress and Serve's own take none)
    ray.init(
        num_cpus=replicas + 1,
        include_dashboard=False,
        logging_level="error",
        log_to_driver=False,
        runtime_env={"env_vars": env},
    )
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServerConfig(model=str(model), kv_cache_gib=kv_cache_gib, compile_decode=False)
        fleet = FleetConfig(replicas=replicas, threads=1, router="pow2" if router == "perfect" else router)
        serve.run(build(config, fleet), name="irminsul", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        # (/health answers 200 once every replica has started, 503 "starting" before)
        wait_for(lambda: httpx.get(url + "/health", timeout=60).status_code == 200, 180, f"{replicas} replicas")
        samples, duration, card, failures = asyncio.run(replay(url, requests, concurrency, max_tokens, progress=False))
        if failures:  # the routers must serve the same requests for their figures to compare
            raise UserFacingError(f"{router}: {len(failures)} requests failed; the first: {failures[0]}")

        def counted():
            counters = fleet_counters(url)
            return counters if sum(r[2] for r in counters) >= len(samples) else None

        per_replica = wait_for(counted, 30, "every replica's counters", interval=0.5)
        return Run(router, summarise(url, samples, duration, card, concurrency), per_replica)
    finally:
        serve.shutdown()
        ray.shutdown()


def ceiling(rendered, rows: int, replicas: int) -> float:
    """What perfect routing (one replica with the fleet's whole pool) computes, as a share of what the
    simulator's prefix policy (Ray's) makes the fleet compute, on the same requests and pools."""
    from irminsul.research.fleet import simulate

    config = SimConfig(pool_tokens=rows)
    ref = reference(rendered, SimConfig(pool_tokens=1))
    interval = ref.interval_s(len(rendered), replicas, config)
    perfect, prefix = (simulate(rendered, p, replicas, config, interval) for p in ("perfect", "prefix"))
    return perfect.computed_tokens / max(1, prefix.computed_tokens)


def report(name: str, runs: dict[str, Run], bound: float | None = None) -> None:
    first = next(iter(runs.values())).result
    rows = [
        (
            r.router,
            f"{r.result.ttft_p50_s * 1e3:.0f} ms",
            f"{r.result.ttft_p95_s * 1e3:.0f} ms",
            f"{r.result.requests_per_s:.2f}",
            f"{r.result.prompt_tokens_per_s:,.0f}",
            f"{r.computed_tokens:,}",
            f"{r.computed_tokens / first.prompt_tokens:.1%}",
            " / ".join(f"{c:,}" for c, _, _ in r.per_replica),
            " / ".join(str(n) for _, _, n in r.per_replica),
            f"{r.max_share:.1%}",
        )
        for r in runs.values()
    ]
    print(
        f"\n**{name}: {first.requests} requests, {first.sessions} sessions, {first.prompt_tokens:,} prompt tokens "
        f"(as the replicas count them), concurrency {first.concurrency}**\n"
    )
    print(
        table(
            (
                "router",
                "TTFT p50",
                "TTFT p95",
                "req/s",
                "prompt tok/s",
                "computed tokens",
                "computed share",
                "computed per replica",
                "requests per replica",
                "busiest's work",
            ),
            rows,
        )
    )
    if "content" in runs:
        c = runs["content"]
        for other in (r for r in ("prefix", "pow2") if r in runs):  # (perfect has its own line)
            o = runs[other]
            print(
                f"content / {other}: computed tokens {c.computed_tokens / max(1, o.computed_tokens):.2f}x, "
                f"TTFT p50 {other} / content {o.result.ttft_p50_s / c.result.ttft_p50_s:.2f}x, "
                f"p95 {o.result.ttft_p95_s / c.result.ttft_p95_s:.2f}x, throughput content / {other} "
                f"{c.result.requests_per_s / o.result.requests_per_s:.2f}x"
            )
        verdicts = [
            f"busiest replica's share of the computed work {c.max_share:.1%} (<= 60%: "
            f"{'met' if c.max_share <= 0.6 else 'not met'})"
        ]
        if "prefix" in runs:
            p = runs["prefix"]
            verdicts.insert(
                0,
                f"TTFT p50 content {c.result.ttft_p50_s * 1e3:.0f} ms, prefix {p.result.ttft_p50_s * 1e3:.0f} ms "
                f"(no worse: {'met' if c.result.ttft_p50_s <= p.result.ttft_p50_s else 'not met'})",
            )
            if "perfect" in runs:
                gap = p.computed_tokens - runs["perfect"].computed_tokens
                closed = (p.computed_tokens - c.computed_tokens) / gap if gap > 0 else float("nan")
                verdicts.insert(
                    0,
                    f"gap to perfect closed (prefix - content) / (prefix - perfect) = ({p.computed_tokens:,} - "
                    f"{c.computed_tokens:,}) / ({p.computed_tokens:,} - {runs['perfect'].computed_tokens:,}) = "
                    f"{closed:.1%} (>= 80%: {'met' if closed >= 0.8 else 'not met'})",
                )
        print("targets: " + "; ".join(verdicts))
    if bound is not None:
        print(
            f"simulator: perfect routing computes {bound:.1%} of the prefix policy's tokens on these requests and pools"
        )


def main(argv=None) -> int:
    from tqdm import tqdm

    from irminsul import LLM

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=150, help="replay each trace's first N requests (default 150)")
    p.add_argument("--concurrency", type=int, default=4, help="sessions replayed at once (default 4)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default=None, help="a checkpoint directory (default: bench_serve.py's tiny Qwen2)")
    p.add_argument("--traces", default=",".join(TRACES), help="agent_meta,rerank,skewed (default all)")
    p.add_argument("--routers", default=",".join(ROUTERS), help="content,prefix,pow2,perfect (default all)")
    p.add_argument("--sim-replicas", default="2,4,8,16,32,64", help="the simulator's fleet sizes")
    p.add_argument("--skip-sim", action="store_true", help="no simulator table")
    args = p.parse_args(argv)
    names, routers = args.traces.split(","), args.routers.split(",")
    unknown = (set(names) - set(TRACES)) | (set(routers) - set(ROUTERS))
    if unknown:
        raise UserFacingError(
            f"unknown traces or routers {sorted(unknown)}: traces {', '.join(TRACES)}; routers {', '.join(ROUTERS)}"
        )
    model = Path(args.model) if args.model else fleet_model()
    bytes_per_row = LLM(str(model), reuse="off", compile_decode=False).engine.pool.bytes_per_slot
    print(f"machine  {describe()}")
    print(
        f"model    {model} ({bytes_per_row} bytes a pool row); {args.replicas} replicas, 1 thread each, "
        f"no shared store; max_tokens {args.max_tokens}"
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        paths, plans, bounds = {}, {}, {}
        for name in names:
            full, paths[name] = Path(tmp) / f"{name}.full.jsonl", Path(tmp) / f"{name}.jsonl"
            irminsul(["workloads", "build", name, "--source", TRACES[name], "--out", str(full)])
            lines = full.read_text().splitlines(keepends=True)[: args.requests]
            paths[name].write_text("".join(lines))
            rendered = list(render_trace(read_trace(paths[name]), TOKENIZER))
            ref = reference(rendered, SimConfig(pool_tokens=1))
            rows = max(1, ref.distinct_tokens // 2)
            plans[name] = (read_trace(paths[name]), rows * bytes_per_row / 2**30)
            bounds[name] = ceiling(rendered, rows, args.replicas)
            print(
                f"{name} ({TRACES[name]}): first {len(lines)} requests, {ref.distinct_tokens:,} distinct content "
                f"tokens; each pool {rows:,} rows (--kv-cache-gib {plans[name][1]:.4f})"
            )
        grid = [(n, r) for n in names for r in routers]
        runs: dict[str, dict[str, Run]] = defaultdict(dict)
        for name, router in tqdm(grid, desc="fleets", file=sys.stderr):
            requests, gib = plans[name]
            n = 1 if router == "perfect" else args.replicas  # perfect: one replica, the fleet's whole pool
            runs[name][router] = run_fleet(
                router, requests, model, gib * args.replicas / n, n, args.concurrency, args.max_tokens
            )
            tqdm.write(f"{name} / {router}: {runs[name][router].result.duration_s:.0f} s", file=sys.stderr)
        print(
            "\nPrefix router: Ray Serve LLM's PrefixCacheAffinityRouter itself (ray 2.60, ray/llm/_internal/serve/"
            "routing_policies/prefix_aware/prefix_aware_router.py), fed the request's messages text; pow2: Serve's "
            "PowerOfTwoChoicesRequestRouter; perfect: one replica whose pool holds the fleet's whole pool "
            f"({args.replicas} x the rows). Computed tokens: every replica's irminsul_computed_tokens_total; "
            "work: computed prompt tokens + generated tokens (irminsul_generation_tokens_total)."
        )
        for name in names:
            report(f"{name} ({TRACES[name]})", runs[name], bounds[name])
        fleet_s = time.perf_counter() - started
        if not args.skip_sim:
            for name in names:
                print(f"\n## simulator: {name} ({TRACES[name]}), the same {args.requests} requests\n", flush=True)
                irminsul(
                    ["bench", "fleet", str(paths[name]), "--replicas", args.sim_replicas, "--tokenizer", TOKENIZER]
                )
    print(f"\nfleets {fleet_s:.0f} s, total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
