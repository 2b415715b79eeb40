"""The fleet on real Ray Serve: two replicas of the bundled model behind the ingress, a real Redis.

One fleet serves the module (it takes ~20 s to start); the test that kills a replica runs last.
"""

import concurrent.futures
import json
import pickle
import time

import httpx
import numpy as np
import pytest

from irminsul.fleet.feed import JournalFeed, RoutingStats, follow, restore
from irminsul.fleet.router import ReplicaLoad, ReplicaView
from irminsul.kvcache.journal import ChunkJournal
from tests.server.server_helpers import text
from tests.support.services import RedisProcess, free_port, wait_for

MODEL = "tiny"


# -- the journal as routing stats (no Ray) ---------------------------------------------------


def test_a_poll_ships_the_churn_not_the_million_chunks_a_replica_holds():
    journal = ChunkJournal()
    rng = np.random.default_rng(0)
    held = rng.integers(1, 2**63, 1 << 20, dtype=np.uint64)
    for f in held.tolist():
        journal.added(f)
    feed = JournalFeed(journal)
    view = ReplicaView("r0")
    restore(view, feed.snapshot())  # a new router: the whole set once, out of band
    assert len(view) == 1 << 20
    sizes = []
    for period in range(6):  # 300 evictions and 300 new chunks per period
        for f in held[period * 300 : (period + 1) * 300].tolist():
            journal.removed(f)
        for f in rng.integers(1, 2**63, 300, dtype=np.uint64).tolist():
            journal.added(f)
        stats = RoutingStats(period + 1, ReplicaLoad(), *feed.cut())
        sizes.append(len(pickle.dumps(stats.as_dict())))
        if period != 2:  # (a router that missed one broadcast catches up from the next)
            assert follow(view, stats)
    assert set(view.chunks.to_array().tolist()) == set(journal.since(None).added.tolist())
    # each answer carries the last 4 periods' changes: 4 x 600 x 8 bytes, plus framing
    assert max(sizes) < 24 * 1024, sizes
    print(f"\nrouting stats per poll, replica of 1,048,576 chunks, 600 changes a period: {max(sizes):,} bytes")


def test_a_router_further_behind_than_the_kept_periods_asks_for_a_snapshot():
    journal = ChunkJournal()
    feed = JournalFeed(journal)
    view = ReplicaView("r0")
    assert follow(view, RoutingStats(1, ReplicaLoad(), *feed.cut()))  # journal at 0: nothing to fetch
    for period in range(6):
        journal.added(1000 + period)
        stats = RoutingStats(period + 2, ReplicaLoad(), *feed.cut())
    assert not follow(view, stats)  # it saw none of the six
    restore(view, feed.snapshot())
    journal.removed(1000)
    assert follow(view, RoutingStats(9, ReplicaLoad(), *feed.cut()))
    assert sorted(view.chunks.to_array().tolist()) == [1001, 1002, 1003, 1004, 1005]


def test_a_burst_chosen_before_any_request_is_accepted_goes_where_the_first_went():
    """Serve chooses every queued request of a burst before the first replica's accept comes back
    (`on_request_routed` is a round trip later), and the replicas' load reports arrive meanwhile:
    each choice must see the choices before it, or the new document is computed on every replica."""
    import asyncio
    from types import SimpleNamespace

    from irminsul.fleet.prompt import RouteKey
    from irminsul.fleet.ray_router import ContentRequestRouter

    router = ContentRequestRouter.__new__(ContentRequestRouter)  # (no Serve: only the routing calls)
    router._deployment_id = SimpleNamespace(name="replicas", app_name="a burst, no Serve")
    router.initialize_state()
    router.fleet._build({"model_id": MODEL, "sink": 4})
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in ("r0", "r1")]
    views = {r: router.fleet.views.setdefault(r, ReplicaView(r)) for r in ("r0", "r1")}
    rng = np.random.default_rng(5)
    doc = rng.integers(5, 30_000, 600).tolist()

    def request(i: int):
        ids = np.array([1, 2, 3, 4, *rng.integers(5, 30_000, 12).tolist(), *doc], np.int32)
        return SimpleNamespace(
            kwargs={"route": RouteKey(ids, None, None)}, metadata=SimpleNamespace(internal_request_id=str(i))
        )

    pending, chosen = [], []
    for i in range(8):
        pending.append(request(i))
        ranked = asyncio.run(router.choose_replicas(replicas, pending[-1]))
        chosen.append(ranked[0][0].replica_id.unique_id)
        # the first replica's report: the requests it has running by now (the router's own count resets)
        views[chosen[0]].load = ReplicaLoad(running=i + 1)
    assert chosen == [chosen[0]] * 8, [p.kwargs["route"].explanation for p in pending]
    # Serve sent one elsewhere (its first choice had no room): the document is on its way there too
    other = "r1" if chosen[0] == "r0" else "r0"
    assert router.fleet.router.assigned(other) == 0
    router.on_request_routed(pending[3], SimpleNamespace(unique_id=other), None)
    assert router.fleet.router.assigned(other) > 0
    for p in pending[:3] + pending[4:]:
        router.on_request_routed(p, SimpleNamespace(unique_id=chosen[0]), None)
    assert not router._decisions


# -- a real fleet --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet():
    import ray
    from ray import serve

    from irminsul.fleet.serve import FleetConfig, build
    from irminsul.kvcache.store import StoreConfig
    from irminsul.server.config import ServerConfig

    redis = RedisProcess()
    env = {"OMP_NUM_THREADS": "1", "IRMINSUL_COMPILE_DECODE": "0"}
    ray.init(num_cpus=3, include_dashboard=False, logging_level="warning", runtime_env={"env_vars": env})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = ServerConfig(
        served_model_name=MODEL,
        kv_cache_gib=0.25,
        compile_decode=False,
        store=StoreConfig((redis.url,)),
        store_secret="fleet-test",
    )
    serve.run(build(config, FleetConfig(replicas=2, stats_period_s=0.5)), name="irminsul", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: httpx.get(url + "/health", timeout=30).json()["status"] == "ok", 60, "two replicas")
    yield url, redis
    serve.shutdown()
    ray.shutdown()
    redis.stop()


def turn(header: str, doc: str, question: str) -> list:
    return [
        {"role": "system", "content": header},
        {"role": "user", "content": [{"type": "text", "text": doc}]},
        {"role": "user", "content": question},
    ]


def post(url: str, messages, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def n_tokens(url: str, doc: str) -> int:
    return httpx.post(url + "/tokenize", json={"prompt": doc}, timeout=30).json()["count"]


def computed(url: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("irminsul_computed_tokens_total{"))


def replica_gauge(url: str, name: str, replica: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return sum(
        float(line.split()[-1])
        for line in lines
        if line.startswith(name + "{") and f'replica="{replica}"' in line.split("}")[0]
    )


def ingress_counter(url: str, name: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name + '{replica="ingress"}'))


def test_the_openai_client_drives_chat_streams_and_completions(fleet):
    import openai

    url, _ = fleet
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
    pieces = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens >= 1
    assert (
        "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
        == client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
        )
        .choices[0]
        .message.content
    )
    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert done.choices[0].text and done.usage.prompt_tokens > 0
    tokens = httpx.post(url + "/tokenize", json={"prompt": "Once upon a time"}, timeout=30).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert 'replica="' in metrics and metrics.count("# TYPE irminsul_computed_tokens_total counter") == 1


def test_a_document_behind_a_new_header_goes_where_it_is_and_is_reused_there(fleet):
    url, redis = fleet
    doc = text(400, 41)
    tokens = n_tokens(url, doc)
    first = post(url, turn("session 1 at 09:00", doc, "Can I change my flight?"))
    holder = first.headers["x-irminsul-replica"]
    assert first.json()["usage"]["irminsul"]["reused_tokens"] == 0
    time.sleep(1.5)  # a stats poll or two: the router now reads the document from the journal
    second = post(url, turn("session 2 at 09:05, agent=support, tier=gold", doc, "And my bags?"))
    route = second.headers["x-irminsul-route"]
    assert second.headers["x-irminsul-replica"] == holder, route
    assert route.startswith(f"{holder}: cost"), route
    usage = second.json()["usage"]
    assert usage["irminsul"]["reused_tokens"] > 0.7 * tokens, (usage, tokens)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["irminsul"]["reused_tokens"]
    assert redis.client().dbsize() > 0  # the shared tier holds the chunks for every replica
    # the other replica does not hold the document, but the store does: the router credits it there
    time.sleep(1.0)  # (the replica's writes to Redis are asynchronous)
    third = post(url, turn("session 3 at 09:07", doc, "And my seat?"))
    other = next(note for note in third.headers["x-irminsul-route"].split(" < ") if not note.startswith(holder))
    assert ", store " in other, third.headers["x-irminsul-route"]


def test_a_burst_for_a_new_document_computes_it_about_once_fleet_wide(fleet):
    url, _ = fleet
    doc = text(400, 77)
    tokens = n_tokens(url, doc)
    before = computed(url)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(lambda i: post(url, turn(f"request {i} of the burst", doc, f"Question {i}?")), range(8))
        )
    usages = [a.json()["usage"] for a in answers]
    prompt_tokens = max(u["prompt_tokens"] for u in usages)
    headers = prompt_tokens - tokens  # the template, the header and the question: computed each time
    wait_for(lambda: computed(url) > before, 10, "the replicas' counters")
    fleet_computed = computed(url) - before
    assert fleet_computed <= tokens * 1.5 + 8 * headers, (fleet_computed, tokens, headers)
    print(
        f"\nburst of 8: {fleet_computed:.0f} prompt tokens computed fleet-wide for a {tokens}-token document "
        f"(+ {headers} header tokens each); replicas {sorted(a.headers['x-irminsul-replica'] for a in answers)}"
    )


def test_killing_a_replica_fails_no_request_that_had_not_started_streaming_on_it(fleet):
    import ray

    url, _ = fleet
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "IrminsulReplica" in a["name"]]
    assert len(names) == 2, names
    doc = text(400, 93)  # the stream's document: the router sends the requests sharing it to the victim
    body = {
        "model": MODEL,
        "messages": turn("a story", doc, "Tell me a long story."),
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 3,
        "stream": True,
    }
    retries_before = ingress_counter(url, "irminsul_fleet_retries_total")
    started = time.monotonic()
    with (
        concurrent.futures.ThreadPoolExecutor(6) as pool,
        httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as streamed,
    ):
        assert streamed.status_code == 200
        victim = streamed.headers["x-irminsul-replica"]
        lines = streamed.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        # requests the victim holds and has not answered (long, so still running when it dies): each
        # must still get its answer, from the other replica
        whole = [
            pool.submit(post, url, turn(f"question {i}", doc, f"Question {i}?"), 300, ignore_eos=True) for i in range(6)
        ]
        # (routed and running there before it dies: on a slow machine the ingress may take longer than
        # the stream's next tokens to route them)
        wait_for(
            lambda: replica_gauge(url, "irminsul_running_requests", victim) >= 2,
            60,
            "the requests running on the victim",
        )
        ray.kill(ray.get_actor(next(n for n in names if n.endswith(victim)), namespace="serve"))
        rest = [first, *(line for line in lines if line)]
        answered = [f.result(timeout=150) for f in whole]  # (post asserts each is a 200)
    retried = [a for a in answered if "x-irminsul-attempts" in a.headers]
    assert retried, [a.headers.get("x-irminsul-route") for a in answered]  # the retries did run
    assert all(a.headers["x-irminsul-replica"] != victim for a in retried)
    assert ingress_counter(url, "irminsul_fleet_retries_total") - retries_before >= len(retried)
    # the stream had shown output: it ends with an error event the client can read, then [DONE]
    assert rest[-1] == "data: [DONE]", rest[-3:]
    events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert "replica serving this stream stopped" in events[-1]["error"]["message"], events[-1]
    assert all(a.json()["choices"][0]["message"]["content"] is not None for a in answered)
    after = post(url, [{"role": "user", "content": "Still there?"}])
    assert after.headers["x-irminsul-replica"] != victim
    print(
        f"\nkilled replica {victim} mid-stream: {len(answered)} answers ({len(retried)} retried on the other "
        f"replica), the stream cut with an error event, "
        f"in {time.monotonic() - started:.1f} s; answered by {sorted(a.headers['x-irminsul-replica'] for a in answered)}"
    )
