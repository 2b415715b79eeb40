"""`irminsul serve` under concurrent streams: errors, resident memory and /metrics, round by round.

Starts `irminsul serve` (the bundled model by default) with a small KV pool, then sends rounds of
N concurrent streaming chat requests with distinct content, so the pool fills with cached rows
and then evicts them. After each round it prints the errors, the server's RSS and the pool gauges:
RSS should level off once the pool is full, and with nothing running every used pool byte is
cached content.

    python benchmarks/bench_serve_load.py [--streams 64] [--rounds 8] [--kv-cache-gib 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import time
from pathlib import Path

import httpx

from irminsul.cli import run_for_people
from irminsul.machine import describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the clone's root, for tests/support
from tests.support.services import ServerProcess, rss_mib  # noqa: E402

WORDS = (
    "policy baggage flight refund cabin upgrade member seat change cancel passenger insurance "
    "reservation economy business gold silver airport delay voucher"
).split()


def gauges(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.match(r"^(irminsul_[a-z_]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


async def stream(client: httpx.AsyncClient, url: str, i: int, rnd: int, words: int) -> str | None:
    rng = random.Random(rnd * 100_000 + i)
    body = {
        "messages": [
            {"role": "system", "content": f"agent {i} round {rnd}"},
            {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))},
        ],
        "max_tokens": 32,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
    }
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return f"HTTP {r.status_code}"
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"error"' in line:
                return line
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--words", type=int, default=200, help="words of new text per request")
    ap.add_argument("--kv-cache-gib", default="0.05")
    args = ap.parse_args()
    extra = ("--model", args.model) if args.model else ()
    server = ServerProcess("--kv-cache-gib", args.kv_cache_gib, *extra)
    print(f"machine: {describe()}\n{args.streams} concurrent streams per round, --kv-cache-gib {args.kv_cache_gib}\n")
    print(
        f"{'round':>5} {'errors':>6} {'seconds':>8} {'RSS MiB':>8} {'running':>8} {'queued':>7} "
        f"{'pool used MiB':>14} {'cached MiB':>11} {'capacity MiB':>13}"
    )
    try:
        print(f"{'start':>5} {'':6} {'':8} {rss_mib(server.proc.pid):8d}")
        for rnd in range(args.rounds):
            t = time.perf_counter()

            async def go():
                async with httpx.AsyncClient(timeout=600) as client:
                    return await asyncio.gather(
                        *(stream(client, server.url, i, rnd, args.words) for i in range(args.streams))
                    )

            errors = [e for e in asyncio.run(go()) if e is not None]
            g = gauges(server.url)
            print(
                f"{rnd:5d} {len(errors):6d} {time.perf_counter() - t:8.1f} {rss_mib(server.proc.pid):8d} "
                f"{g['irminsul_running_requests']:8.0f} {g['irminsul_queued_requests']:7.0f} "
                f"{g['irminsul_kv_pool_bytes_used'] / 2**20:14.1f} {g['irminsul_cached_bytes'] / 2**20:11.1f} "
                f"{g['irminsul_kv_pool_bytes_capacity'] / 2**20:13.1f}"
            )
            for e in errors[:3]:
                print(f"      {e}")
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
