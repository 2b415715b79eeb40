"""`irminsul bench serve TRACE --url URL`: replay a trace against a running server.

Sessions run concurrently (up to ``--concurrency``); the turns of one session run in order, as an
agent would send them. Every request streams, so TTFT is measured at the first chunk that carries
output; the usage block of the last chunk says where each prompt row came from. The report: TTFT
p50/p95, throughput, and the share of prompt tokens by kind (exact prefix, reused chunks,
carve-out recomputed, computed).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

from irminsul.errors import UserFacingError
from irminsul.machine import describe


def register_bench(sub) -> None:
    p = sub.add_parser("serve", help="replay a trace against a running server: TTFT, throughput, cached tokens")
    p.add_argument("trace", help="trace JSONL (irminsul workloads build ...)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--concurrency", type=int, default=4, help="sessions replayed at once (turns stay in order)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--api-key", default=None, help="bearer key, if the server asks for one")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run_bench)


KINDS = ("prefix_tokens", "reused_tokens", "carve_out_tokens", "computed_tokens")


@dataclass(frozen=True)
class Sample:
    session: str
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    split: dict  # usage["irminsul"]


@dataclass(frozen=True)
class BenchResult:
    url: str
    model: str
    reuse: str
    machine: str
    requests: int
    sessions: int
    concurrency: int
    duration_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_mean_s: float
    requests_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    fraction: dict  # kind -> share of prompt tokens
    failed: int = 0  # requests the server refused or failed (not in the figures above)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def _body(request, model: str, max_tokens: int) -> tuple[str, dict]:
    common = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.pretokenized:  # segments are lost on /v1/completions: prefer chat traces
        return "/v1/completions", {**common, "prompt": list(request.token_ids)}
    body = {**common, "messages": list(request.messages)}
    if request.tools:
        body["tools"] = list(request.tools)
    return "/v1/chat/completions", body


async def _one(client, url: str, request, model: str, max_tokens: int) -> Sample:
    path, body = _body(request, model, max_tokens)
    t0 = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path} answered {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{path} failed mid-stream: {chunk['error']['message']}")
            for c in chunk.get("choices") or []:
                has_output = (c.get("delta") or {}).get("content") or c.get("text") or c.get("finish_reason")
                if ttft is None and has_output:
                    ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    latency = time.perf_counter() - t0
    return Sample(
        request.session,
        ttft if ttft is not None else latency,
        latency,
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage.get("irminsul", {}),
    )


async def replay(
    url: str, requests, concurrency: int, max_tokens: int, api_key: str | None = None, progress: bool = True
) -> tuple[list[Sample], float, dict, list[str]]:
    """-> (samples, seconds, the model card, why each failed request failed). A request the server
    refuses (a prompt longer than its context, say) is counted and the replay goes on."""
    import httpx

    sessions: dict[str, list] = defaultdict(list)
    for r in requests:
        sessions[r.session].append(r)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency)
    samples: list[Sample] = []
    failures: list[str] = []
    async with httpx.AsyncClient(timeout=None, headers=headers) as client:
        try:
            card = (await client.get(url + "/v1/models")).json()["data"][0]
        except httpx.HTTPError as e:
            raise UserFacingError(f"--url {url}: no server answers there ({type(e).__name__}: {e})") from None

        async def session(turns):
            async with gate:
                for r in turns:
                    try:
                        samples.append(await _one(client, url, r, card["id"], max_tokens))
                    except RuntimeError as e:
                        failures.append(str(e))
                    if progress:
                        print(f"\r{len(samples) + len(failures)}/{len(requests)} requests", end="", flush=True)

        t0 = time.perf_counter()
        await asyncio.gather(*(session(t) for t in sessions.values()))
        duration = time.perf_counter() - t0
    if progress:
        print()
    return samples, duration, card, failures


def summarise(
    url: str, samples: list[Sample], duration: float, card: dict, concurrency: int, failed: int = 0
) -> BenchResult:
    ttft = [s.ttft_s for s in samples]
    prompt = sum(s.prompt_tokens for s in samples)
    fraction = {k.removesuffix("_tokens"): sum(s.split.get(k, 0) for s in samples) / max(1, prompt) for k in KINDS}
    return BenchResult(
        url=url,
        model=card["id"],
        reuse=card.get("irminsul", {}).get("reuse", "?"),
        machine=describe(),
        requests=len(samples),
        sessions=len({s.session for s in samples}),
        concurrency=concurrency,
        duration_s=duration,
        ttft_p50_s=percentile(ttft, 0.5),
        ttft_p95_s=percentile(ttft, 0.95),
        ttft_mean_s=sum(ttft) / max(1, len(ttft)),
        requests_per_s=len(samples) / duration,
        prompt_tokens_per_s=prompt / duration,
        output_tokens_per_s=sum(s.completion_tokens for s in samples) / duration,
        prompt_tokens=prompt,
        fraction=fraction,
        failed=failed,
    )


def run_bench(args) -> int:
    from irminsul.research.workloads.trace import read_trace

    requests = read_trace(args.trace)[: args.limit]
    samples, duration, card, failures = asyncio.run(
        replay(args.url, requests, args.concurrency, args.max_tokens, args.api_key, progress=not args.json)
    )
    if not samples:
        raise UserFacingError(
            f"all {len(failures)} requests failed; the first: {failures[0]}"
            if failures
            else "the trace has no requests"
        )
    result = summarise(args.url, samples, duration, card, args.concurrency, len(failures))
    if args.json:
        print(json.dumps({"trace": str(args.trace), **asdict(result)}))
        return 0
    f = result.fraction
    print(f"server   {result.url}  model {result.model}  reuse {result.reuse}")
    print(f"machine  {result.machine} (client side)")
    print(
        f"trace    {args.trace}: {result.requests} requests, {result.sessions} sessions, "
        f"concurrency {result.concurrency}, max_tokens {args.max_tokens}"
    )
    print(
        f"TTFT     p50 {result.ttft_p50_s * 1e3:.0f} ms   p95 {result.ttft_p95_s * 1e3:.0f} ms   "
        f"mean {result.ttft_mean_s * 1e3:.0f} ms"
    )
    print(
        f"through  {result.requests_per_s:.2f} req/s   {result.prompt_tokens_per_s:.0f} prompt tok/s   "
        f"{result.output_tokens_per_s:.1f} output tok/s   ({result.duration_s:.1f} s)"
    )
    print(
        f"prompt   {result.prompt_tokens} tokens: prefix {f['prefix']:.1%}  reused {f['reused']:.1%}  "
        f"computed {f['computed']:.1%} (of which carve-out {f['carve_out']:.1%})"
    )
    if failures:
        print(f"failed   {len(failures)} requests, not counted above; the first: {failures[0]}")
    return 0
