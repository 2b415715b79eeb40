"""Hostile requests against the fleet's ingress on real Ray Serve: two keyed replicas of the bundled model.

The single server's fuzzers (tests/server/test_fuzz_sizes.py, test_fuzz_hostile.py, test_hardening.py)
attack `irminsul serve`; here the same inputs go through the ingress, which reads every body, renders its
prompt for the router and forwards it: every list and map of every endpoint as long as the body limit lets
it be, malformed JSON, wrong content types, bad and absent keys, huge headers, a body that never finishes.
Each gets an answer below 500 (the server's error shape where it is the ingress's or a replica's), and
after the barrage the fleet still answers a chat and /health is 200 with both replicas ready.

One fleet serves the module (it takes ~20 s to start); the test that checks the fleet lives runs last.
"""

import json
import socket
import time

import httpx
import pytest

from tests.server.test_fuzz_sizes import BODY_LIMIT, corpus
from tests.support.services import RedisProcess, ServerProcess, free_port, wait_for

MODEL = "tiny"
ALICE, ADMIN = "alice-key", "admin-key"
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
BODY_PATHS = [CHAT, COMPLETIONS, RESPONSES, "/tokenize", "/detokenize", "/v1/cache/chunks"]
BODY_TIMEOUT = 2.0  # --timeout-body of the fleet below: a body that never finishes is refused after this
REQUEST_TIMEOUT = 60.0  # one answer through the ingress (a body at the limit is read twice, and sent on)


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
        api_keys=((ALICE, "alice"),),
        admin_key=ADMIN,
        timeout_body=BODY_TIMEOUT,
    )
    serve.run(build(config, FleetConfig(replicas=2, stats_period_s=0.5)), name="irminsul", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: httpx.get(url + "/health", timeout=30).json()["status"] == "ok", 60, "two replicas")
    yield url
    serve.shutdown()
    ray.shutdown()
    redis.stop()


@pytest.fixture(scope="module")
def single():
    """`irminsul serve` with the same model and keys: what the single server answers the same input."""
    server = ServerProcess(
        "--served-model-name",
        MODEL,
        "--api-key",
        f"{ALICE}=alice",
        "--admin-key",
        ADMIN,
        "--no-compile-decode",
        "--log-level",
        "warning",
    )
    yield server.url
    server.stop()


def key_for(path: str) -> str:
    return ADMIN if path == "/v1/cache/chunks" else ALICE


def send(url: str, path: str, content: bytes, headers: dict | None = None) -> httpx.Response | str:
    """The answer, or what went wrong asking."""
    try:
        return httpx.post(
            url + path,
            content=content,
            headers={"Authorization": f"Bearer {key_for(path)}", "Content-Type": "application/json", **(headers or {})},
            timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=10),
        )
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


def problem(r: httpx.Response | str) -> str | None:
    """What is wrong with an answer to a hostile request: none, a 5xx, or a 4xx without the error shape."""
    if isinstance(r, str):
        return f"no answer: {r}"
    if r.status_code >= 500:
        return f"answered {r.status_code}: {r.text[:300]}"
    if r.status_code >= 400:
        try:
            error = r.json()["error"]
            assert isinstance(error["message"], str) and error["message"]
        except Exception:
            return f"a {r.status_code} without the server's error shape: {r.text[:300]}"
    if len(r.content) > BODY_LIMIT:
        return f"the answer is {len(r.content):,} bytes, more than a request may be"
    return None


def raw(port: int, request: bytes, wait: float) -> bytes | None:
    """Send `request` on a socket as it is, then read until the server closes it or `wait` seconds pass
    without a byte; what came back (None: nothing)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return out or None


def status_of(answer: bytes | None) -> int | None:
    if not answer or not answer.startswith(b"HTTP/1.1 "):
        return None
    return int(answer.split(b" ", 2)[1])


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# -- sizes -------------------------------------------------------------------------------------


def test_requests_as_large_as_the_body_limit_get_no_5xx_through_the_ingress(fleet):
    from irminsul.bundled import bundled_model
    from irminsul.model.tokenizer import Tokenizer

    failures, table = [], []
    for what, path, build in corpus(Tokenizer(bundled_model("mla"))):
        n, content = build()
        assert len(content) <= BODY_LIMIT, (what, len(content))
        t0 = time.monotonic()
        r = send(fleet, path, content)
        row = f"{what[:60]:60} ({path}) n={n:<8} {len(content) / 2**20:5.2f} MiB  {time.monotonic() - t0:5.1f} s  "
        table.append(row + (f"{r.status_code} {r.text[:100]!r}" if isinstance(r, httpx.Response) else r))
        if p := problem(r):
            failures.append(f"{what} ({path}), n={n:,}: {p}")
    print("\n" + "\n".join(table))
    assert not failures, "\n".join(failures) + "\n\nevery request:\n" + "\n".join(table)


# -- malformed bodies, content types, keys ---------------------------------------------------------

MALFORMED = [
    ("not JSON", b"{not json"),
    ("truncated JSON", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"'),
    ("empty", b""),
    ("a JSON list", b"[1, 2, 3]"),
    ("a JSON string", b'"hello"'),
    ("null", b"null"),
    ("invalid UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe\xfd"}'),
    (
        "a lone surrogate",
        b'{"model": "tiny", "prompt": "\\ud800", "messages": [{"role": "user", "content": "\\ud800"}]}',
    ),
    ("nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000),
    ("an object nested 100,000 deep", b'{"a": ' * 100_000 + b"1" + b"}" * 100_000),
    ("NaN everywhere", b'{"model": "tiny", "prompt": NaN, "messages": NaN, "max_tokens": NaN}'),
    ("a 5,000-digit max_tokens", b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"),
    ("wrong types", b'{"model": 1, "prompt": {}, "messages": "hi", "tokens": "x", "input": 5}'),
    ("binary", bytes(range(256)) * 64),
]
CONTENT_TYPES = [
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/octet-stream",
    "application/json; charset=latin-1",
    "",
]
GOOD = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    RESPONSES: {"model": MODEL, "input": "hi", "max_output_tokens": 2},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [5, 6]},
    "/v1/cache/chunks": {"model": MODEL, "text": "hi"},
}


def cases():
    """(what, path, body, headers) for every malformed body, content type and key, on every path."""
    for path in BODY_PATHS:
        for what, body in MALFORMED:
            yield what, path, body, {}
        for ctype in CONTENT_TYPES:
            yield f"content type {ctype!r}", path, json.dumps(GOOD[path]).encode(), {"Content-Type": ctype}
        good = json.dumps(GOOD[path]).encode()
        yield "a form body", path, b"model=tiny&prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"}
        yield "no key", path, good, {"Authorization": ""}
        yield "an unknown key", path, good, {"Authorization": "Bearer nobody"}
        yield "the key without Bearer", path, good, {"Authorization": key_for(path)}
        yield "a Basic key", path, good, {"Authorization": "Basic YWxpY2U6a2V5"}
        yield "a 4 KiB key", path, good, {"Authorization": "Bearer " + "k" * 4096}
        yield "the other key", path, good, {"Authorization": f"Bearer {ADMIN if key_for(path) == ALICE else ALICE}"}


def test_malformed_bodies_content_types_and_keys_get_the_servers_answers(fleet, single):
    failures, table = [], []
    for what, path, body, headers in cases():
        ours, theirs = send(fleet, path, body, headers), send(single, path, body, headers)
        got = [r.status_code if isinstance(r, httpx.Response) else r for r in (ours, theirs)]
        table.append(f"{what[:40]:40} {path:20} fleet {got[0]}  serve {got[1]}")
        if p := problem(ours):
            failures.append(f"{what} ({path}): {p}")
        elif got[0] != got[1]:
            failures.append(f"{what} ({path}): the fleet answers {got[0]}, irminsul serve {got[1]}: {ours.text[:200]}")
    print("\n" + "\n".join(table))
    assert not failures, "\n".join(failures)


# -- the connection: headers and bodies ------------------------------------------------------------


def test_huge_headers_get_no_5xx(fleet):
    port, failures, table = port_of(fleet), [], []
    body = json.dumps(GOOD[CHAT]).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {ALICE}\r\n"
        "Content-Type: application/json\r\n"
    )
    tail = f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    for what, extra in [
        ("one 1 MiB header", b"X-Big: " + b"a" * 2**20 + b"\r\n"),
        ("one 64 KiB header", b"X-Big: " + b"a" * 65536 + b"\r\n"),
        ("10,000 headers", b"".join(b"X-H%d: v\r\n" % i for i in range(10_000))),
        ("a 1 MiB path", None),
    ]:
        request = (
            f"GET /{'p' * 2**20} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
            if extra is None
            else head.encode() + extra + tail
        )
        answer = raw(port, request, 30)
        status = status_of(answer)
        table.append(f"{what}: {status or 'closed unanswered'}")
        # refused (a 4xx, or the connection closed unanswered) or served: anything but a 5xx
        if status is not None and status >= 500:
            failures.append(f"{what}: {answer[:300]!r}")
    print("\n" + "\n".join(table))
    assert not failures, failures
    assert httpx.get(fleet + "/health", timeout=10).status_code == 200


def test_a_body_that_never_finishes_is_refused_at_the_body_deadline_while_others_are_served(fleet):
    port = port_of(fleet)
    head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\nContent-Type: application/json\r\n"
    slow = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(4)]
    try:
        for i, s in enumerate(slow):
            framing = "Content-Length: 1000\r\n\r\n" if i % 2 else "Transfer-Encoding: chunked\r\n\r\n"
            s.sendall((head + framing).encode() + (b'{"model": ' if i % 2 else b'a\r\n{"model": \r\n'))
        started = time.monotonic()
        r = httpx.post(
            fleet + CHAT,
            json=GOOD[CHAT],
            headers={"Authorization": f"Bearer {ALICE}"},
            timeout=REQUEST_TIMEOUT,
        )
        assert r.status_code == 200, r.text
        for s in slow:
            out = b""
            try:
                while chunk := s.recv(65536):
                    out += chunk
                    if b"\r\n\r\n" in out and b'"error"' in out:
                        break
            except (TimeoutError, ConnectionResetError):
                pass
            assert status_of(out) == 408, out[:300]
            assert "did not arrive in time" in out.split(b"\r\n\r\n", 1)[1].decode(errors="replace"), out[:300]
        # (at the deadline, not at once, and not much later)
        assert BODY_TIMEOUT * 0.9 <= time.monotonic() - started < BODY_TIMEOUT + 20
    finally:
        for s in slow:
            s.close()
    assert httpx.get(fleet + "/health", timeout=10).status_code == 200


# -- and the fleet lives (last) ---------------------------------------------------------------


def test_after_the_barrage_the_fleet_answers_and_is_healthy(fleet):
    r = httpx.post(
        fleet + CHAT,
        json={"model": MODEL, "messages": [{"role": "user", "content": "Still there?"}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {ALICE}"},
        timeout=REQUEST_TIMEOUT,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None
    health = httpx.get(fleet + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    assert health.json()["replicas_ready"] == 2, health.text
