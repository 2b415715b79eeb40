"""A soak of `irminsul serve`: two tenants, sampled and constrained streams at temperature 1, cancels.

Starts `irminsul serve` (the bundled model, `pic`, two API keys) and keeps N streams open for D
seconds. Each stream is one of: a sampled chat completion, a `json_schema` response, a forced tool
call (`tool_choice="required"`), a sampled completion; both tenants send all kinds, with shared
documents behind changing headers so the cache is hit. A share of the streams (20% by default) is
cancelled mid-stream by the client. It reports server errors (5xx, or an error event in a stream),
constraint failures (a 4xx from a valid request, output that does not parse, a forced call with no
call), the server's resident memory over time, and the pool once the traffic stops:

    python benchmarks/soak.py [--streams 32] [--seconds 300] [--cancel 0.2]

Exits 1 if any server error or constraint failure happened.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from irminsul.cli import run_for_people
from irminsul.machine import describe
from irminsul.server.testing import ServerProcess, rss_mib

KEYS = {"key-alpha": "alpha", "key-beta": "beta"}
WORDS = ("policy baggage flight refund cabin upgrade member seat change cancel passenger insurance "
         "reservation economy business gold silver airport delay voucher").split()
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "confidence"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "look a booking up",
                                         "parameters": {"type": "object",
                                                        "properties": {"code": {"type": "string", "maxLength": 12}},
                                                        "required": ["code"]}}}


def documents(n: int = 6, words: int = 150) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def request(rng: random.Random, docs: list[str]) -> tuple[str, str, dict]:
    """(kind, path, body) of one request."""
    header = f"session {rng.randrange(10**6)}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 12)))
    question = "what does the document say about " + rng.choice(WORDS) + "?"
    messages = [{"role": "system", "content": header}, {"role": "user", "content": rng.choice(docs) + "\n" + question}]
    common = {"temperature": 1.0, "stream": True, "max_tokens": rng.choice([16, 32, 48])}
    kind = rng.choice(["chat", "json", "tool", "completion"])
    if kind == "chat":
        return kind, "/v1/chat/completions", {"messages": messages, **common}
    if kind == "json":
        return kind, "/v1/chat/completions", {"messages": messages, **common, "max_tokens": 96,
                                              "response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "a", "schema": SCHEMA}}}
    if kind == "tool":
        return kind, "/v1/chat/completions", {"messages": messages, **common, "max_tokens": 64, "tools": [TOOL],
                                              "tool_choice": "required"}
    return kind, "/v1/completions", {"prompt": header + "\n" + rng.choice(docs), **common}


async def one(client: httpx.AsyncClient, url: str, key: str, rng: random.Random, docs, cancel: float,
              tally: Counter, failures: list[str]) -> None:
    kind, path, body = request(rng, docs)
    cut = rng.random() < cancel
    text, calls, reason = [], {}, None
    try:
        async with client.stream("POST", url + path, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code >= 500:
                tally["server errors"] += 1
                failures.append(f"{kind}: HTTP {r.status_code} {(await r.aread())[:200]!r}")
                return
            if r.status_code != 200:
                tally["constraint failures" if kind in ("json", "tool") else "client errors"] += 1
                failures.append(f"{kind}: HTTP {r.status_code} {(await r.aread())[:200]!r}")
                return
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    status = chunk["error"].get("code") or 500
                    tally["server errors" if str(status).startswith("5") else "constraint failures"] += 1
                    failures.append(f"{kind}: stream error {chunk['error']}")
                    return
                events += 1
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta") or {}
                    text.append(delta.get("content") or choice.get("text") or "")
                    for call in delta.get("tool_calls") or []:
                        calls[call["index"]] = calls.get(call["index"], "") + (call.get("function", {}).get("arguments") or "")
                    reason = choice.get("finish_reason") or reason
                if cut and events >= 3:
                    tally["cancelled"] += 1
                    return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        tally["server errors"] += 1
        failures.append(f"{kind}: {type(e).__name__} {e}")
        return
    tally[f"{kind} done"] += 1
    if kind == "json" and reason == "stop":
        try:
            out = json.loads("".join(text))
            assert set(out) == {"answer", "confidence"}
        except (ValueError, AssertionError):
            tally["constraint failures"] += 1
            failures.append(f"json: output does not match the schema: {''.join(text)[:200]!r}")
    if kind == "tool" and reason in ("tool_calls", "stop"):
        try:
            args = json.loads(calls[0])
            assert isinstance(args.get("code"), str)
        except (KeyError, ValueError, AssertionError):
            tally["constraint failures"] += 1
            failures.append(f"tool: no valid call ({reason}): {calls!r} {''.join(text)[:100]!r}")


async def soak(url: str, pid: int, streams: int, seconds: float, cancel: float) -> tuple[Counter, list[str], list]:
    docs, tally, failures, rss = documents(), Counter(), [], []
    stop_at = time.monotonic() + seconds

    async def worker(i: int) -> None:
        rng = random.Random(i)
        key = list(KEYS)[i % 2]
        while time.monotonic() < stop_at:
            await one(client, url, key, rng, docs, cancel, tally, failures)

    async def sample_rss() -> None:
        start = time.monotonic()
        while time.monotonic() < stop_at:
            rss.append((time.monotonic() - start, rss_mib(pid)))
            await asyncio.sleep(5)

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=streams + 4)) as client:
        await asyncio.gather(sample_rss(), *(worker(i) for i in range(streams)))
    return tally, failures, rss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--cancel", type=float, default=0.2, help="share of streams the client cancels mid-stream")
    ap.add_argument("--kv-cache-gib", default="0.1")
    args = ap.parse_args()
    extra = ("--model", args.model) if args.model else ()
    keys = [a for k, t in KEYS.items() for a in ("--api-key", f"{k}={t}")]
    server = ServerProcess("--kv-cache-gib", args.kv_cache_gib, "--max-running-requests", str(args.streams),
                           *keys, *extra, timeout=600)
    print(f"machine: {describe()}\n{args.streams} streams for {args.seconds:.0f} s, two tenants, temperature 1, "
          f"{args.cancel:.0%} cancelled, --kv-cache-gib {args.kv_cache_gib}\n")
    try:
        start_rss = rss_mib(server.proc.pid)
        tally, failures, rss = asyncio.run(soak(server.url, server.proc.pid, args.streams, args.seconds, args.cancel))
        time.sleep(1)
        metrics = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer key-alpha"}).text
        gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith(("irminsul_kv_pool_bytes_used", "irminsul_cached_bytes", "irminsul_running_requests"))}
        alive = server.proc.poll() is None
    finally:
        server.stop()
    done = sum(v for k, v in tally.items() if k.endswith(" done"))
    print(f"{'requests completed':>24}: {done}  ({', '.join(f'{k} {v}' for k, v in sorted(tally.items()) if k.endswith(' done'))})")
    for name in ("cancelled", "server errors", "constraint failures", "client errors"):
        print(f"{name:>24}: {tally.get(name, 0)}")
    peak = max(r for _, r in rss) if rss else -1
    mid = [r for t, r in rss if t >= args.seconds / 2]
    print(f"{'server alive':>24}: {alive}")
    print(f"{'RSS MiB':>24}: start {start_rss}, peak {peak}, second half {min(mid, default=-1)}–{max(mid, default=-1)}, "
          f"end {rss[-1][1] if rss else -1}")
    print(f"{'after the traffic':>24}: running {gauges.get('irminsul_running_requests', -1):.0f}, pool used "
          f"{gauges.get('irminsul_kv_pool_bytes_used', -1) / 2**20:.1f} MiB, cached "
          f"{gauges.get('irminsul_cached_bytes', -1) / 2**20:.1f} MiB")
    for f in failures[:10]:
        print("   ", f)
    return 1 if tally.get("server errors") or tally.get("constraint failures") or not alive else 0


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
