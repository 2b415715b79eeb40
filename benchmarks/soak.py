"""A soak of `irminsul serve`: two tenants, sampled and constrained streams at temperature 1, cancels,
and requests of hostile sizes mixed in.

Starts `irminsul serve` (the bundled model, `pic`, two API keys) and keeps N streams open for D
seconds. Each stream is one of: a sampled chat completion, a `json_schema` response, a forced tool
call (`tool_choice="required"`), a sampled completion; both tenants send all kinds, with shared
documents behind changing headers so the cache is hit. A share of the streams (20% by default) is
cancelled mid-stream by the client, and a share of the requests (10%) is one of the hostile sizes
(`HOSTILE`: thousands of Responses items, a whole-vocabulary logit_bias, tools of thousands of
properties, megabytes of metadata, stop lists, tokens to detokenize), which must get an answer
below 500. It reports server errors (5xx, or an error event in a stream), constraint failures (a
4xx from a valid request, output that does not parse, a forced call with no call), the server's
resident memory over time, /health's slowest answer (probed every 0.25 s), the event loop's
longest stall (/metrics), and the pool once the traffic stops:

    python benchmarks/soak.py [--streams 32] [--seconds 300] [--cancel 0.2] [--hostile 0.1]

Exits 1 if any server error or constraint failure happened, the server died, or the pool holds
more than its cached rows once the traffic stopped.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the clone's root, for tests/support
from tests.support.services import ServerProcess, rss_mib  # noqa: E402

KEYS = {"key-alpha": "alpha", "key-beta": "beta"}
WORDS = (
    "policy baggage flight refund cabin upgrade member seat change cancel passenger insurance "
    "reservation economy business gold silver airport delay voucher"
).split()
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 40},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "look a booking up",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "maxLength": 12}},
            "required": ["code"],
        },
    },
}


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
        return (
            kind,
            "/v1/chat/completions",
            {
                "messages": messages,
                **common,
                "max_tokens": 96,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
            },
        )
    if kind == "tool":
        return (
            kind,
            "/v1/chat/completions",
            {"messages": messages, **common, "max_tokens": 64, "tools": [TOOL], "tool_choice": "required"},
        )
    return kind, "/v1/completions", {"prompt": header + "\n" + rng.choice(docs), **common}


def _responses_calls(n: int) -> dict:
    calls = [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in range(n)]
    return {"input": calls + [{"type": "function_call_output", "call_id": "c0", "output": "ok"}] * n}


def _tools(n_tools: int, n_props: int, n_enum: int) -> list[dict]:
    props = {f"p{j}": {"type": "string", "enum": [f"v{k}" for k in range(n_enum)]} for j in range(n_props)}
    return [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": props}}}
        for i in range(n_tools)
    ]


HI = [{"role": "user", "content": "hi"}]
HOSTILE = {  # name -> (path, body): each must be answered below 500, in its turn, hurting nobody else
    "4,000 Responses calls": ("/v1/responses", _responses_calls(4000)),
    "2,000 Responses calls": ("/v1/responses", _responses_calls(2000)),
    "logit_bias, all ids, n=8": (
        "/v1/completions",
        {"prompt": "hi", "n": 8, "max_tokens": 16, "logit_bias": {str(i): 1 for i in range(8192)}},
    ),
    "logit_bias, 300 ids, n=8": (
        "/v1/completions",
        {"prompt": "hi", "n": 8, "max_tokens": 16, "logit_bias": {str(i): 1 for i in range(300)}},
    ),
    "tools 20 x 400 x 50": ("/v1/chat/completions", {"messages": HI, "tools": _tools(20, 400, 50)}),
    "metadata 7 MB": ("/v1/responses", {"input": "hi", "stream": True, "metadata": {"k": "v" * 7_000_000}}),
    "100,000 stop strings": ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 100_000}),
    "100,000 messages": ("/v1/chat/completions", {"messages": HI * 100_000}),
    "1,000,000 ids to detokenize": ("/detokenize", {"tokens": [65] * 1_000_000}),
    "10,000 prompts": ("/v1/completions", {"prompt": ["hi"] * 10_000}),
}


async def hostile(
    client: httpx.AsyncClient, url: str, key: str, rng: random.Random, bodies: dict, tally: Counter, failures: list[str]
) -> None:
    name = rng.choice(sorted(bodies))
    path, body = bodies[name]
    try:
        r = await client.post(
            url + path, content=body, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        )
    except httpx.HTTPError as e:
        tally["server errors"] += 1
        failures.append(f"hostile {name}: {type(e).__name__} {e}")
        return
    if r.status_code >= 500:
        tally["server errors"] += 1
        failures.append(f"hostile {name}: HTTP {r.status_code} {r.text[:200]!r}")
    else:
        tally["hostile answered"] += 1


async def one(
    client: httpx.AsyncClient,
    url: str,
    key: str,
    rng: random.Random,
    docs,
    cancel: float,
    tally: Counter,
    failures: list[str],
) -> None:
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
                        calls[call["index"]] = calls.get(call["index"], "") + (
                            call.get("function", {}).get("arguments") or ""
                        )
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


async def soak(
    url: str, pid: int, streams: int, seconds: float, cancel: float, share: float
) -> tuple[Counter, list[str], list, list]:
    docs, tally, failures, rss, health = documents(), Counter(), [], [], []
    bodies = {name: (path, json.dumps(body).encode()) for name, (path, body) in HOSTILE.items()}
    stop_at = time.monotonic() + seconds

    async def worker(i: int) -> None:
        rng = random.Random(i)
        key = list(KEYS)[i % 2]
        while time.monotonic() < stop_at:
            if rng.random() < share:
                await hostile(client, url, key, rng, bodies, tally, failures)
            else:
                await one(client, url, key, rng, docs, cancel, tally, failures)

    async def probe_health() -> None:
        async with httpx.AsyncClient(timeout=60) as own:  # its own connection: never queued behind the streams
            while time.monotonic() < stop_at:
                t0 = time.monotonic()
                r = await own.get(url + "/health")
                health.append((time.monotonic() - t0, r.status_code))
                await asyncio.sleep(0.25)

    async def sample_rss() -> None:
        start = time.monotonic()
        while time.monotonic() < stop_at:
            rss.append((time.monotonic() - start, rss_mib(pid)))
            await asyncio.sleep(5)

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=streams + 4)) as client:
        await asyncio.gather(sample_rss(), probe_health(), *(worker(i) for i in range(streams)))
    return tally, failures, rss, health


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--cancel", type=float, default=0.2, help="share of streams the client cancels mid-stream")
    ap.add_argument("--hostile", type=float, default=0.1, help="share of requests of hostile sizes (HOSTILE)")
    ap.add_argument("--kv-cache-gib", default="0.1")
    args = ap.parse_args()
    extra = ("--model", args.model) if args.model else ()
    keys = [a for k, t in KEYS.items() for a in ("--api-key", f"{k}={t}")]
    server = ServerProcess(
        "--kv-cache-gib", args.kv_cache_gib, "--max-running-requests", str(args.streams), *keys, *extra, timeout=600
    )
    print(
        f"machine: {describe()}\n{args.streams} streams for {args.seconds:.0f} s, two tenants, temperature 1, "
        f"{args.cancel:.0%} cancelled, {args.hostile:.0%} of hostile sizes, --kv-cache-gib {args.kv_cache_gib}\n"
    )
    try:
        start_rss = rss_mib(server.proc.pid)
        idle = min(_timed(lambda: httpx.get(server.url + "/health")) for _ in range(20))
        tally, failures, rss, health = asyncio.run(
            soak(server.url, server.proc.pid, args.streams, args.seconds, args.cancel, args.hostile)
        )
        time.sleep(1)
        metrics = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer key-alpha"}).text
        gauges = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith(
                (
                    "irminsul_kv_pool_bytes_used",
                    "irminsul_cached_bytes",
                    "irminsul_running_requests",
                    "irminsul_event_loop_stall_seconds_max",
                )
            )
        }
        alive = server.proc.poll() is None
    finally:
        server.stop()
    done = sum(v for k, v in tally.items() if k.endswith(" done"))
    print(
        f"{'requests completed':>24}: {done}  ({', '.join(f'{k} {v}' for k, v in sorted(tally.items()) if k.endswith(' done'))})"
    )
    for name in ("cancelled", "hostile answered", "server errors", "constraint failures", "client errors"):
        print(f"{name:>24}: {tally.get(name, 0)}")
    peak = max(r for _, r in rss) if rss else -1
    mid = [r for t, r in rss if t >= args.seconds / 2]
    print(f"{'server alive':>24}: {alive}")
    print(
        f"{'RSS MiB':>24}: start {start_rss}, peak {peak}, second half {min(mid, default=-1)}–{max(mid, default=-1)}, "
        f"end {rss[-1][1] if rss else -1}"
    )
    print(
        f"{'after the traffic':>24}: running {gauges.get('irminsul_running_requests', -1):.0f}, pool used "
        f"{gauges.get('irminsul_kv_pool_bytes_used', -1) / 2**20:.1f} MiB, cached "
        f"{gauges.get('irminsul_cached_bytes', -1) / 2**20:.1f} MiB"
    )
    slow = sorted(t for t, _ in health)
    print(
        f"{'/health':>24}: idle {idle * 1e3:.1f} ms; under the soak median {slow[len(slow) // 2] * 1e3:.1f} ms, "
        f"slowest {slow[-1] * 1e3:.0f} ms ({len(slow)} probes, {sum(c != 200 for _, c in health)} not 200)"
    )
    print(f"{'event loop stall':>24}: longest {gauges.get('irminsul_event_loop_stall_seconds_max', -1) * 1e3:.0f} ms")
    for f in failures[:10]:
        print("   ", f)
    # once every request is done, the pool holds cached content only
    leaked = (
        gauges.get("irminsul_kv_pool_bytes_used", 0) > gauges.get("irminsul_cached_bytes", 0)
        or gauges.get("irminsul_running_requests", 0) > 0
    )
    return 1 if tally.get("server errors") or tally.get("constraint failures") or not alive or leaked else 0


def _timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
