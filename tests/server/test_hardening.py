"""One client cannot hurt another: keys before bodies, bounded preparation, slow clients closed,
one engine call per step, no 500 from what a body holds, one framing per request."""

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from tests.server.server_helpers import HealthProbe, closed_within, start
from tests.support.services import free_port, wait_for

KEY_A, KEY_B = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def keyed(tiny_dir):
    s = start(
        tiny_dir, api_keys=(("ka", "a"), ("kb", "b")), admin_key="root", prep_threads=4, prep_threads_per_tenant=2
    )
    yield s
    s.stop()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _exchange(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send raw bytes, read until the server closes the connection (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(timeout)
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


@pytest.mark.parametrize(
    "path", ["/tokenize", "/detokenize", "/v1/completions", "/v1/chat/completions", "/v1/responses"]
)
def test_every_endpoint_with_a_body_checks_the_key_before_reading_it(keyed, path):
    # headers announce a body that never comes: only an answer before reading it can arrive
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", _port(keyed.url))) as s:
        s.settimeout(10)
        s.sendall(head)
        assert s.recv(100).startswith(b"HTTP/1.1 401"), path
    r = httpx.post(keyed.url + path, json={}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]


def test_the_tokenizer_endpoints_work_with_a_key(keyed):
    ids = httpx.post(keyed.url + "/tokenize", json={"prompt": "hello", "add_special_tokens": False}, headers=KEY_A)
    assert ids.status_code == 200, ids.text
    text = httpx.post(keyed.url + "/detokenize", json={"tokens": ids.json()["tokens"]}, headers=KEY_A).json()
    assert text["prompt"] == "hello"


DIGITS = b"1" * 5000
HUGE_INTS = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + DIGITS + b"}", KEY_A),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "guided_json": "' + DIGITS + b'"}', KEY_A),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + DIGITS + b"}", KEY_A),
    ("/v1/responses", b'{"input": "hi", "max_output_tokens": -' + DIGITS + b"}", KEY_A),
    ("/tokenize", b'{"prompt": "hi", "x": [' + DIGITS + b"]}", KEY_A),
    ("/detokenize", b'{"tokens": [' + DIGITS + b"]}", KEY_A),
    ("/v1/cache/chunks", b'{"token_ids": [' + DIGITS + b"]}", {"Authorization": "Bearer root"}),
]


@pytest.mark.parametrize("path, body, headers", HUGE_INTS, ids=[f"{i}-{c[0]}" for i, c in enumerate(HUGE_INTS)])
def test_an_integer_of_thousands_of_digits_is_a_400(keyed, path, body, headers):
    r = httpx.post(keyed.url + path, content=body, headers={**headers, "Content-Type": "application/json"})
    assert r.status_code == 400 and "more than 4300 digits" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(
    "path, body", [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": HI})]
)
def test_n_choices_from_the_largest_seed_stay_in_range(keyed, path, body):
    r = httpx.post(
        keyed.url + path,
        headers=KEY_A,
        timeout=60,
        json={**body, "n": 3, "seed": 2**63 - 1, "max_tokens": 2, "temperature": 1},
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text


def test_a_request_with_two_framings_is_refused_and_its_connection_closed(keyed):
    body = b'{"prompt": "hi", "max_tokens": 1}'
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    raw = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ka\r\nContent-Type: application/json\r\n"
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(body)
        + body
        + b"\r\n0\r\n\r\n"
        + smuggled
    )
    out = _exchange(_port(keyed.url), raw)
    assert out.startswith(b"HTTP/1.1 400") and b"Content-Length and Transfer-Encoding" in out, out[:300]
    assert out.count(b"HTTP/1.1") == 1  # the connection closed: nothing after it was read as a request


def test_a_text_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(keyed, monkeypatch):
    state = keyed.app.state.irminsul
    calls = []
    for name in ("encode", "encode_text"):
        real = getattr(state.tokenizer, name)
        monkeypatch.setattr(state.tokenizer, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    big = "word " * 200_000  # 1 MB: far more than 4,096 tokens can hold
    for path, body in [
        ("/v1/completions", {"prompt": big}),
        ("/v1/completions", {"prompt": ["hi", big]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": big[:600_000]}, {"type": "text", "text": big[:600_000]}],
                    }
                ]
            },
        ),
        ("/v1/responses", {"input": big}),
        ("/tokenize", {"prompt": big}),
        ("/tokenize", {"messages": [{"role": "user", "content": big}]}),
    ]:
        r = httpx.post(keyed.url + path, json=body, headers=KEY_A, timeout=30)
        assert r.status_code == 400 and "maximum context length is 4096 tokens" in r.json()["error"]["message"], (
            path,
            r.text,
        )
    assert calls == []
    r = httpx.post(keyed.url + "/v1/completions", json={"prompt": "x" * 5000}, headers=KEY_A)  # fits the bound:
    assert r.status_code == 400 and "resulted in 5001 tokens" in r.json()["error"]["message"]  # tokenized (BOS + 5000)


def test_one_tenant_holds_at_most_its_share_of_the_preparation_threads(keyed, monkeypatch):
    """Tenant a's preparations block (as a huge constraint's compile would); tenant b's request is
    still prepared and answered, and a never holds more than its two threads."""
    from irminsul.server.serving_completion import OpenAIServingCompletion

    real, release = OpenAIServingCompletion.prepare, threading.Event()
    held, most, lock = [0], [0], threading.Lock()

    def prepare(self, request, req):
        if request.headers.get("authorization") == KEY_A["Authorization"]:
            with lock:
                held[0] += 1
                most[0] = max(most[0], held[0])
            try:
                release.wait(60)
            finally:
                with lock:
                    held[0] -= 1
        return real(self, request, req)

    monkeypatch.setattr(OpenAIServingCompletion, "prepare", prepare)
    body = {"prompt": "hi", "max_tokens": 2}

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            flood = [
                asyncio.create_task(client.post(keyed.url + "/v1/completions", json=body, headers=KEY_A))
                for _ in range(8)
            ]
            await asyncio.sleep(0.5)
            try:
                b = await client.post(keyed.url + "/v1/completions", json=body, headers=KEY_B, timeout=20)
                b_done_while_a_blocked = not release.is_set()
            finally:
                release.set()
            return b, b_done_while_a_blocked, await asyncio.gather(*flood)

    b, in_time, flood = asyncio.run(run())
    assert b.status_code == 200 and in_time
    assert all(r.status_code == 200 for r in flood) and most[0] == 2


def test_calls_on_the_engine_thread_take_turns_with_steps(keyed):
    """Several long engine-thread calls queued at once (echo scoring, publishing) run one per
    engine step, so a running stream keeps getting tokens between them."""
    import concurrent.futures

    client = keyed.app.state.irminsul.client
    steps = [0]
    real_step = client._step

    def counted():
        steps[0] += 1
        real_step()

    client._step = counted
    try:
        with httpx.stream(
            "POST",
            keyed.url + "/v1/completions",
            headers=KEY_A,
            timeout=60,
            json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True},
        ) as r:
            lines = r.iter_lines()
            next(lines)  # the stream is running
            seen = [client.call(lambda: steps[0]) for _ in range(5)]
            at = [f.result(30) for f in concurrent.futures.as_completed(seen)]
    finally:
        client._step = real_step
    assert len(set(at)) == 5, at  # a step between every two calls


def test_an_echo_whose_client_left_stops_scoring(tiny_dir, monkeypatch):
    """completions echo + logprobs scores the prompt on the engine thread after the job ran, in
    --max-prefill-tokens passes; a client that leaves meanwhile stops it between two passes (it
    once scored to the end for nobody)."""
    from irminsul.engine.engine import ScoringCancelled

    s = start(tiny_dir, max_prefill_tokens=64)
    try:
        engine = s.app.state.irminsul.client.engine
        passes, ended = [], []
        real_logits, real_score = engine.runner.logits, engine.score

        def slow_logits(*a, **k):  # (each pass a little slower, so the client leaves mid-way)
            passes.append(1)
            time.sleep(0.05)
            return real_logits(*a, **k)

        def score(*a, **k):
            try:
                out = real_score(*a, **k)
            except ScoringCancelled:
                ended.append("cancelled")
                raise
            ended.append("finished")
            return out

        monkeypatch.setattr(engine.runner, "logits", slow_logits)
        monkeypatch.setattr(engine, "score", score)
        body = json.dumps(
            {"prompt": [3 + i % 250 for i in range(1920)], "echo": True, "logprobs": 2, "max_tokens": 1}
        ).encode()
        with socket.create_connection(("127.0.0.1", _port(s.url))) as c:
            c.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            wait_for(lambda: len(passes) >= 5, 30, "the scoring to start")
        wait_for(lambda: ended, 30, "the scoring to end")
        assert ended == ["cancelled"] and len(passes) < 30, (ended, len(passes))  # 30 passes score it all
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        s.stop()


def test_n_choices_of_an_echoed_prompt_score_it_once(keyed, monkeypatch):
    engine = keyed.app.state.irminsul.client.engine
    calls, real = [], engine.score
    monkeypatch.setattr(engine, "score", lambda *a, **k: calls.append(1) or real(*a, **k))
    r = httpx.post(
        keyed.url + "/v1/completions",
        headers=KEY_A,
        timeout=60,
        json={"prompt": ["hello there", "and here"], "n": 3, "echo": True, "logprobs": 1, "max_tokens": 1},
    )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 6 and len(calls) == 2, (len(choices), len(calls))  # one scoring per prompt
    firsts = [c["logprobs"]["token_logprobs"][:3] for c in choices]
    assert firsts[0] == firsts[1] == firsts[2] and firsts[3] == firsts[4] == firsts[5]


def test_a_large_response_is_built_off_the_event_loop(keyed, monkeypatch):
    from irminsul.server.serving_completion import CompletionFormat

    where = []
    real = CompletionFormat.response
    monkeypatch.setattr(
        CompletionFormat, "response", lambda self, *a: where.append(threading.current_thread().name) or real(self, *a)
    )
    r = httpx.post(
        keyed.url + "/v1/completions",
        headers=KEY_A,
        timeout=60,
        json={"prompt": ["hello there", "and here"], "echo": True, "logprobs": 5, "max_tokens": 2},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["top_logprobs"][0] is None, r.text
    assert where and all(name.startswith("irminsul-prep") for name in where), where


@pytest.mark.parametrize("calls", [2000, 4000])
def test_a_long_responses_input_is_converted_off_the_loop_in_linear_time(guarded, calls):
    """N function_call items and N outputs of the first call: the conversion to chat messages once
    rebuilt the set of call ids per output on the event loop (quadratic; 2,000 calls held /health
    for seconds). Now an input of more items than a chat may have messages is refused up front, and
    one within the bound is converted in linear time on a worker thread: /health answers meanwhile."""
    items = [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in range(calls)]
    items += [{"type": "function_call_output", "call_id": "c0", "output": "ok"}] * calls
    answer = []
    worst = _health_while(
        guarded.url,
        lambda: answer.append(
            httpx.post(guarded.url + "/v1/responses", json={"input": items, "max_output_tokens": 2}, timeout=120)
        ),
    )
    r = answer[0]
    assert r.status_code == 400, r.text
    expected = "at most 4096 per request" if 2 * calls > 4096 else "maximum context length"
    assert expected in r.json()["error"]["message"], r.text
    assert worst < 1.0, worst


def test_responses_metadata_is_bounded_as_openai_bounds_it(keyed):
    big = {f"k{i}": "v" * 512 for i in range(17)}
    r = httpx.post(keyed.url + "/v1/responses", json={"input": "hi", "metadata": big}, headers=KEY_A, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata", r.text
    ok = {f"k{i}": "v" * 512 for i in range(16)}
    r = httpx.post(
        keyed.url + "/v1/responses",
        json={"input": "hi", "metadata": ok, "max_output_tokens": 2},
        headers=KEY_A,
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["metadata"] == ok, r.text


# -- slow clients: the server as `irminsul serve` runs it ------------------------------------------------------


class GuardedServer:
    """The app under uvicorn with `irminsul serve`'s HTTP settings (cli.uvicorn_config), in a thread."""

    def __init__(self, tiny_dir, **overrides):
        import uvicorn

        from irminsul.server.app import create_app
        from irminsul.server.cli import uvicorn_config
        from irminsul.server.config import ServerConfig

        config = ServerConfig(model=str(tiny_dir), served_model_name="tiny", port=free_port(), **overrides)
        self.port, self.url = config.port, f"http://127.0.0.1:{config.port}"
        self.server = uvicorn.Server(uvicorn_config(create_app(config), config, "warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 60, "uvicorn")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture(scope="module")
def guarded(tiny_dir):
    s = GuardedServer(tiny_dir, timeout_header=1.0, timeout_body=1.0, timeout_write=1.0, max_connections=24)
    yield s
    s.stop()


def test_slow_headers_and_slow_bodies_are_closed_while_others_are_served(guarded):
    slow_headers = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(10)]
    slow_body = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(5)]
    silent = socket.create_connection(("127.0.0.1", guarded.port))  # connects and sends nothing
    try:
        for s in slow_headers:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for s in slow_body:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt": '
            )
        r = httpx.post(guarded.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        for s in slow_headers:
            s.sendall(b"X-Slow: 1\r\n")  # still sending, but not fast enough
        for s, phase in [
            *((s, b"headers") for s in slow_headers),
            *((s, b"body") for s in slow_body),
            (silent, b"headers"),
        ]:
            out = closed_within(s, 10)
            assert out is not None and out.startswith(b"HTTP/1.1 408") and phase in out, out
        assert httpx.get(guarded.url + "/health", timeout=5).status_code == 200
    finally:
        for s in [*slow_headers, *slow_body, silent]:
            s.close()


def test_connections_beyond_the_cap_are_refused_at_once(guarded):
    held = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(24)]
    try:
        wait_for(lambda: len(guarded.server.server_state.connections) >= 24, 5, "24 open connections")
        with socket.create_connection(("127.0.0.1", guarded.port)) as extra:
            out = closed_within(extra, 5)
            assert out is not None and out.startswith(b"HTTP/1.1 503"), out
    finally:
        for s in held:
            s.close()
    # the held ones are gone (closed by the client, or by the header deadline): served again
    wait_for(lambda: len(guarded.server.server_state.connections) == 0, 10, "the connections to close")
    assert httpx.get(guarded.url + "/health", timeout=5).status_code == 200


def _health_while(url: str, busy) -> float:
    """The longest /health took while `busy()` ran (probed every 0.1 s from another thread)."""
    probe = HealthProbe(url, period=0.1).start()
    t0 = time.monotonic()
    try:
        busy()
    finally:
        probe.stop()
    return probe.worst(t0, time.monotonic())


def test_answers_nobody_reads_are_dropped_after_the_write_deadline(guarded):
    """Clients that ask for a large answer and never read it (a 4 KiB receive window) hold their
    connections only until the write deadline (--timeout-write, 1 s here): then they are aborted,
    the answers' memory freed, and the connection cap is everyone's again."""
    state = guarded.server.config.app.state.irminsul
    prompt = "x" * (state.context * state.max_token_bytes)  # the longest text /tokenize takes
    body = json.dumps({"prompt": prompt}).encode()
    request = (
        f"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    readers = []
    try:
        for _ in range(3):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", guarded.port))
            # pipelined: more answer (~6 MB) than the kernel's socket buffers take (4 MiB at most)
            s.sendall(request * 24)
            readers.append(s)
        wait_for(lambda: len(guarded.server.server_state.connections) >= 3, 10, "the readers' connections")
        wait_for(lambda: len(guarded.server.server_state.connections) == 0, 20, "the unread connections to be dropped")
        assert httpx.get(guarded.url + "/health", timeout=5).status_code == 200
    finally:
        for s in readers:
            s.close()


def test_a_body_of_tiny_chunks_is_refused_without_stalling_the_loop(guarded):
    """A chunked body is one event per chunk on the event loop: 100,000 one-byte chunks are refused
    with a 413 once the body has come in more pieces than any honest client sends, and /health
    stays answered meanwhile."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunks = b"".join(b"1\r\n" + bytes([c]) + b"\r\n" for c in b'{"prompt": "' + b"a" * 100_000)
    out = []

    def send():
        with socket.create_connection(("127.0.0.1", guarded.port)) as s:
            try:
                s.sendall(head + chunks)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused and closed before the rest was sent
            out.append(closed_within(s, 20))

    worst = _health_while(guarded.url, send)
    assert out[0] is not None and out[0].startswith(b"HTTP/1.1 413") and b"pieces" in out[0], out
    assert worst < 1.0, worst


def test_a_keep_alive_connection_is_served_again(guarded):
    with httpx.Client(timeout=10) as client:
        for _ in range(3):
            assert client.get(guarded.url + "/health").status_code == 200
            time.sleep(0.4)  # idle between requests, under the keep-alive timeout: the same connection


def test_serve_options_reach_the_config():
    import argparse

    from irminsul.server.cli import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        [
            "serve",
            "--timeout-header",
            "3",
            "--timeout-body",
            "7",
            "--timeout-keep-alive",
            "2",
            "--max-connections",
            "99",
            "--prep-threads",
            "6",
            "--prep-threads-per-tenant",
            "3",
            "--log-repeats",
            "4",
            "--timeout-write",
            "9",
            "--redis-timeout",
            "0.5",
            "--threads",
            "1",
        ]
    )
    c = config_from_args(args)
    assert (c.timeout_header, c.timeout_body, c.timeout_keep_alive, c.connection_limit) == (3, 7, 2, 99)
    assert (c.timeout_write, c.store.redis_timeout_s, c.threads) == (9, 0.5, 1)
    assert (c.prep_threads, c.prep_threads_per_tenant, c.log_repeats) == (6, 3, 4)
    from irminsul.server.config import ServerConfig, ServerConfigError

    with pytest.raises(ServerConfigError, match="--timeout-header"):
        ServerConfig(timeout_header=0)
    with pytest.raises(ServerConfigError, match="--prep-threads-per-tenant"):
        ServerConfig(prep_threads=2, prep_threads_per_tenant=3)
    assert 16 <= ServerConfig().connection_limit <= 4096


# -- a log that cannot flood ----------------------------------------------------------------------------------


def test_a_repeated_warning_is_logged_a_few_times_a_minute_and_the_rest_counted():
    from irminsul.server.logs import RepeatFilter

    now = [0.0]
    flt = RepeatFilter(limit=3, interval=60, clock=lambda: now[0])
    out = []
    handler = logging.Handler()
    handler.emit = lambda record: out.append(record.getMessage())
    handler.addFilter(flt)
    logger = logging.getLogger("irminsul.test.repeats")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        for i in range(1000):
            logger.warning("client %d sent an invalid request", i)
            logger.info("served %d", i)  # below WARNING: never held back
        logger.error("something else")
        invalid = [m for m in out if "invalid" in m]
        assert len(invalid) == 4 and "left out" in invalid[-1]
        assert len([m for m in out if m.startswith("served")]) == 1000 and "something else" in out
        now[0] = 61.0
        logger.warning("client %d sent an invalid request", 1000)
        assert out[-1].startswith("client 1000 sent an invalid request") and "996 more like this" in out[-1]
    finally:
        logger.removeHandler(handler)
