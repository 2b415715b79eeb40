"""Continuous batching under load: 64 concurrent streams, budgets held, a long prompt stalls nobody."""

import asyncio
import json

import httpx

from tests.server.server_helpers import metric, start, text

BUDGETS = dict(max_prefill_tokens=256, kv_cache_gib=0.004)  # a pool of about 1,800 tiny-model rows


async def stream(client, url, prompt, max_tokens=8):
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces, usage, reason = [], None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                pieces.append(chunk["choices"][0]["text"])
                reason = chunk["choices"][0]["finish_reason"] or reason
            usage = chunk.get("usage") or usage
    return "".join(pieces), reason, usage


def test_64_concurrent_streams_complete_within_budgets(tiny_dir):
    s = start(tiny_dir, **BUDGETS)
    try:
        prompts = [f"{i}: " + text(12 + i % 5, 100 + i) for i in range(64)]
        # references, one at a time (greedy decoding is batch-invariant here)
        refs = [
            httpx.post(
                s.url + "/v1/completions",
                json={"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            ).json()
            for p in prompts
        ]

        async def run_all():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(stream(client, s.url, p) for p in prompts))

        results = asyncio.run(run_all())
        for (got, reason, usage), ref in zip(results, refs):
            assert reason == "length" and usage["completion_tokens"] == 8
            assert got == ref["choices"][0]["text"]
        assert metric(s.url, "irminsul_running_requests") == 0 and metric(s.url, "irminsul_queued_requests") == 0
        used, capacity = metric(s.url, "irminsul_kv_pool_bytes_used"), metric(s.url, "irminsul_kv_pool_bytes_capacity")
        assert 0 < used <= capacity < 0.004 * 2**30 + 1
        assert metric(s.url, "irminsul_cached_bytes") == used  # nothing runs: every held row is cached
    finally:
        s.stop()


def test_a_long_request_does_not_stall_short_ones(tiny_dir):
    s = start(tiny_dir, **{**BUDGETS, "max_prefill_tokens": 64})
    try:
        order = []

        async def tagged(client, name, prompt, max_tokens):
            await stream(client, s.url, prompt, max_tokens)
            order.append(name)

        async def run():
            async with httpx.AsyncClient(timeout=120) as client:
                # ~2,100 prompt tokens prefilled 64 per step, then 64 decode steps
                long = asyncio.create_task(tagged(client, "long", text(300, 7), 64))
                while metric(s.url, "irminsul_running_requests") < 1 and not long.done():
                    await asyncio.sleep(0.01)
                assert not long.done(), "the long request ended before it was seen running: make it longer"
                await tagged(client, "short", "hi", 2)  # rides along in the long request's steps
                await long

        asyncio.run(run())
        assert order == ["short", "long"]
    finally:
        s.stop()


def test_disconnected_clients_are_aborted_and_freed(server):
    from tests.support.services import wait_for

    body = {"model": "tiny", "prompt": text(20, 9), "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break  # leave mid-stream
        try:
            client.post(server.url + "/v1/completions", json=body, timeout=0.5)  # non-streaming, gives up
        except httpx.TimeoutException:
            pass
    wait_for(lambda: metric(server.url, "irminsul_requests_total", finish_reason="abort") >= 2, 20, "both aborts")
    wait_for(lambda: metric(server.url, "irminsul_running_sequences") == 0, 20, "freed rows")
    assert metric(server.url, "irminsul_cached_bytes") == metric(server.url, "irminsul_kv_pool_bytes_used")
    assert metric(server.url, "irminsul_running_requests") == 0
