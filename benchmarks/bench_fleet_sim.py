"""The fleet simulator's tables and what a replica ships per poll (model-free, CPU only).

    python benchmarks/bench_fleet_sim.py                        # agent_meta (tau_bench), rerank and skewed (musique)
    python benchmarks/bench_fleet_sim.py --replicas 2,64 --skip-table

Prints the machine; per trace the `irminsul bench fleet` table (the same code); then the bytes one
poll of a replica's chunk journal carries when it holds 1 M chunks and turns over as many chunks per
request as a replica of the simulated fleet does on agent_meta.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from irminsul.cli import main as irminsul
from irminsul.fleet.router import ContentRouter, ReplicaView
from irminsul.kvcache.journal import ChunkJournal
from irminsul.machine import describe
from irminsul.research.fleet import FleetConfig, SimReplica, reference
from irminsul.research.workloads.render import render_trace
from irminsul.research.workloads.trace import read_trace
from irminsul.table import table

TRACES = {"agent_meta": "tau_bench", "rerank": "musique", "skewed": "musique"}


def churn_per_request(trace, config: FleetConfig) -> float:
    """Journal changes (additions + removals) per request of one replica with a full pool."""
    replica = SimReplica("r0", config.pool_tokens, config)
    for i, (_, r) in enumerate(trace):
        replica.serve(float(i), r.token_ids.astype(np.int64), r.segment_starts)
    return replica.journal.seq / len(trace)


def bytes_per_poll(resident: int, changes_per_poll: int, polls: int = 20) -> dict:
    """A journal of `resident` chunks; each poll period adds and evicts changes_per_poll / 2 each."""
    rng = np.random.default_rng(0)
    journal, view = ChunkJournal(), ReplicaView("r0")
    live = rng.integers(0, 2**63, resident, dtype=np.uint64).tolist()
    for f in live:
        journal.added(f)
    t = time.perf_counter()
    first = journal.since(None)
    view.apply(first)
    full_s = time.perf_counter() - t
    sizes, apply_s = [], []
    oldest = 0
    for _ in range(polls):
        for f in rng.integers(0, 2**63, changes_per_poll // 2, dtype=np.uint64).tolist():
            journal.added(f)
            live.append(f)
        for f in live[oldest : oldest + changes_per_poll // 2]:  # the pool evicts its oldest
            journal.removed(f)
        oldest += changes_per_poll // 2
        delta = journal.since(view.seq)
        t = time.perf_counter()
        view.apply(delta)
        apply_s.append(time.perf_counter() - t)
        sizes.append(delta.nbytes)
    assert len(view) == len(journal)
    router = ContentRouter("m")
    t = time.perf_counter()
    router.choose(rng.integers(5, 30_000, 5000), {"r0": view})
    return dict(
        full_bytes=first.nbytes,
        full_apply_s=full_s,
        poll_bytes=float(np.mean(sizes)),
        poll_apply_s=float(np.mean(apply_s)),
        view_bytes_per_chunk=view.chunks.nbytes / len(view),
        choose_s=time.perf_counter() - t,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="1,2,4,8,16,32,64")
    ap.add_argument("--skip-table", action="store_true")
    ap.add_argument("--requests-per-poll", type=int, default=10, help="requests a replica serves between polls")
    args = ap.parse_args()
    print(describe())
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for pattern, source in TRACES.items():
            paths[pattern] = Path(tmp) / f"{pattern}.jsonl"
            irminsul(["workloads", "build", pattern, "--source", source, "--out", str(paths[pattern])])
        if not args.skip_table:
            for pattern, path in paths.items():
                print(f"\n## {pattern} ({TRACES[pattern]})\n", flush=True)
                irminsul(["bench", "fleet", str(path), "--replicas", args.replicas])
        trace = list(render_trace(read_trace(paths["agent_meta"]), "deepseek"))
    ref = reference(trace, FleetConfig(pool_tokens=1))
    churn = churn_per_request(trace, FleetConfig(pool_tokens=ref.distinct_tokens // 2))
    changes = max(2, int(round(churn * args.requests_per_poll)))
    m = bytes_per_poll(1 << 20, changes)
    print(
        f"\njournal churn on agent_meta: {churn:.1f} changes per request (a replica with half the distinct "
        f"content); {args.requests_per_poll} requests per poll: {changes} changes"
    )
    print(
        table(
            (
                "replica holds",
                "first poll (whole set)",
                "each poll after",
                "apply a poll",
                "router view per chunk",
                "choose (5k-token prompt)",
            ),
            [
                (
                    "1,048,576 chunks",
                    f"{m['full_bytes'] / 2**20:.1f} MiB",
                    f"{m['poll_bytes']:.0f} B",
                    f"{m['poll_apply_s'] * 1e3:.2f} ms",
                    f"{m['view_bytes_per_chunk']:.1f} B",
                    f"{m['choose_s'] * 1e3:.2f} ms",
                )
            ],
        )
    )


if __name__ == "__main__":
    main()
