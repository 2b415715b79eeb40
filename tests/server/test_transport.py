"""The HTTP transport of `irminsul serve` under a low open-file limit, over raw sockets: pipelined
requests, clients that write a byte at a time, a body of 300,000 one-byte chunks, and more clients
than there are connection slots that never read their answers. However a connection misbehaves,
/health (probed every 0.25 s on fresh connections from its own thread) stays answered within
max(1 s, 4x its idle latency), a misbehaving request is refused or answered within its bound, an
ordinary client is served, and the server lives; clients that hold every connection slot lose them
once the write deadline passes.

The server runs in its own process with RLIMIT_NOFILE at 256 and --max-connections 128 (what half
of that limit gives), with short deadlines so that each scenario ends in seconds. The scenarios
share it, in file order; each starts by waiting for /health to be quick again.
"""

import contextlib
import itertools
import json
import resource
import socket
import threading
import time

import httpx
import pytest

from tests.server.server_helpers import HealthProbe, closed_within, loop_stall
from tests.support.services import ServerProcess

KEY = "transport-key"
AUTH = f"Authorization: Bearer {KEY}\r\n"
OPEN_FILES, MAX_CONNECTIONS = 256, 128
# --timeout-header, --timeout-body, --timeout-write: the write deadline long enough for every slow reader to
# be connected and waiting (sending them their requests takes seconds) before the first is dropped
TIMEOUT_HEADER, TIMEOUT_BODY, TIMEOUT_WRITE = 3.0, 10.0, 15.0
SLACK = 10.0  # seconds past a deadline before the closing it brings is a failure
REQUEST_TIMEOUT = 20.0  # seconds an answer may take; longer is a stall, reported as a failure
CHUNKS, CHUNKS_BOUND = 300_000, 5.0  # one-byte chunks of one body; seconds to refuse or answer it
HEALTH_FLOOR, HEALTH_TIMES_IDLE = 1.0, 4.0


@contextlib.contextmanager
def open_file_limit(n: int):
    """The soft RLIMIT_NOFILE at `n` while the block runs (a process started in it keeps the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Served:
    def __init__(self, server: ServerProcess, bound: float):
        self.server, self.bound = server, bound
        self.port, self.url = server.port, server.url

    def ready(self) -> None:
        """The server alive, and /health quick again (an earlier scenario may have left it busy)."""
        assert self.server.proc.poll() is None, f"the server died:\n{self.server.log.read_text()[-2000:]}"
        end = time.monotonic() + 30
        while time.monotonic() < end:
            start = time.monotonic()
            try:
                if httpx.get(self.url + "/health", timeout=self.bound).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(max(0.0, 0.25 - (time.monotonic() - start)))
        pytest.fail("the server did not answer /health within the bound for 30 s before the scenario")

    def probe(self) -> HealthProbe:
        return HealthProbe(self.url).start()


@pytest.fixture(scope="module")
def served(tiny_dir):
    with open_file_limit(OPEN_FILES):
        server = ServerProcess(
            "--model",
            str(tiny_dir),
            "--served-model-name",
            "tiny",
            "--api-key",
            f"{KEY}=alice",
            "--no-compile-decode",
            "--log-level",
            "warning",
            "--max-connections",
            str(MAX_CONNECTIONS),
            "--timeout-header",
            str(TIMEOUT_HEADER),
            "--timeout-body",
            str(TIMEOUT_BODY),
            "--timeout-write",
            str(TIMEOUT_WRITE),
        )
    try:
        limits = open(f"/proc/{server.proc.pid}/limits").read()
        assert any(
            line.startswith("Max open files") and line.split()[3] == str(OPEN_FILES) for line in limits.splitlines()
        ), limits
        idle = []
        for _ in range(8):
            start = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            idle.append(time.monotonic() - start)
            time.sleep(0.1)
        yield Served(server, max(HEALTH_FLOOR, HEALTH_TIMES_IDLE * max(idle)))
    finally:
        server.stop()


def request(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n{AUTH}{extra}"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


def read_response(f) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response from a socket's file: (status, headers, body)."""
    status_line = f.readline()
    if not status_line:
        raise EOFError("the server closed the connection")
    status = int(status_line.split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, f.read(int(headers["content-length"]))
    body = b""
    if headers.get("transfer-encoding") == "chunked":
        while size := int(f.readline().split(b";")[0], 16):
            body += f.read(size)
            f.readline()
        f.readline()
    return status, headers, body


def served_normally(served: Served) -> list[str]:
    """What went wrong for an ordinary client: a chat completion and a /tokenize, answered in time."""
    problems = []
    headers = {"Authorization": f"Bearer {KEY}"}
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        ("/tokenize", {"prompt": "hello"}),
    ]:
        try:
            r = httpx.post(served.url + path, json=body, headers=headers, timeout=REQUEST_TIMEOUT)
            if r.status_code != 200:
                problems.append(f"an ordinary {path} got {r.status_code}: {r.text[:200]}")
        except httpx.HTTPError as e:
            problems.append(f"an ordinary {path} got no answer: {type(e).__name__}: {e}")
    return problems


# -- the scenarios (in this order: the slow readers, last, hold every slot until their deadline) -----------


def test_pipelined_requests_are_answered_in_order(served):
    """Several requests in one write, on one connection: each answered, in the order sent, and the
    connection still serves the next request."""
    served.ready()
    sent = [
        ("GET", "/health", None),
        ("POST", "/tokenize", {"prompt": "a", "add_special_tokens": False}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "ab", "add_special_tokens": False}),
        ("POST", "/detokenize", {"tokens": [104, 105]}),
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("POST", "/tokenize", {"prompt": "abc", "add_special_tokens": False}),
    ]
    raw = b"".join(request(m, p, json.dumps(b).encode() if b is not None else b"") for m, p, b in sent)
    with socket.create_connection(("127.0.0.1", served.port)) as s:
        s.settimeout(REQUEST_TIMEOUT)
        s.sendall(raw)
        f = s.makefile("rb")
        answers = [read_response(f) for _ in sent]
        s.sendall(request("POST", "/tokenize", json.dumps({"prompt": "abcd", "add_special_tokens": False}).encode()))
        after = read_response(f)
    assert [a[0] for a in answers] == [200] * len(sent), [(a[0], a[2][:200]) for a in answers]
    bodies = [json.loads(a[2]) for a in answers]
    assert bodies[0] == {"status": "ok"} and bodies[2]["data"][0]["id"] == "tiny", bodies[:3]
    assert [bodies[i]["count"] for i in (1, 3, 6)] == [1, 2, 3], bodies
    assert bodies[4]["prompt"] == "hi" and bodies[5]["object"] == "text_completion", bodies[4:6]
    assert after[0] == 200 and json.loads(after[2])["count"] == 4, after


def test_slow_writers_are_closed_at_their_deadlines_while_others_are_served(served):
    """Headers and bodies sent a byte every 0.5 s: each connection gets a 408 and is closed within
    its deadline (--timeout-header from the first byte, --timeout-body from the end of the headers),
    while /health stays quick and an ordinary client is served."""
    served.ready()
    probe = served.probe()
    headers = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(16)]
    bodies = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(16)]
    trickles = {
        s: request("POST", "/v1/completions", extra="Content-Type: application/json\r\n")[:-2] + b"X: " + b"y" * 1000
        for s in headers
    }
    body = json.dumps({"prompt": "a" * 1000}).encode()
    for s in bodies:
        s.sendall(request("POST", "/v1/completions", body)[: -len(body)])
        trickles[s] = body
    deadline = {**{s: TIMEOUT_HEADER for s in headers}, **{s: TIMEOUT_BODY for s in bodies}}
    start, closed, problems = time.monotonic(), {}, []
    try:
        normal = threading.Thread(target=lambda: problems.extend(served_normally(served)))
        normal.start()
        sent = 0
        while len(closed) < len(trickles) and time.monotonic() - start < max(deadline.values()) + SLACK:
            for s, data in trickles.items():
                if s in closed:
                    continue
                try:
                    s.sendall(data[sent : sent + 1])
                    s.settimeout(0)
                    out = s.recv(4096)  # the server answered (a 408) or closed
                    closed[s] = (time.monotonic() - start, out)
                except (TimeoutError, BlockingIOError):
                    pass
                except OSError as e:
                    closed[s] = (time.monotonic() - start, f"{type(e).__name__}".encode())
            sent += 1
            time.sleep(0.5)
        normal.join(REQUEST_TIMEOUT + 5)
        worst = probe.worst(start, time.monotonic())
    finally:
        probe.stop()
        for s in trickles:
            s.close()
    for s in trickles:
        what = "headers" if s in headers else "body"
        if s not in closed:
            problems.append(
                f"a connection sending its {what} a byte at a time was still open {deadline[s] + SLACK:.0f} s later"
            )
        elif closed[s][0] > deadline[s] + SLACK or not closed[s][1].startswith(b"HTTP/1.1 408"):
            problems.append(
                f"a connection sending its {what} a byte at a time got {closed[s][1][:80]!r} "
                f"after {closed[s][0]:.1f} s (deadline {deadline[s]:.0f} s)"
            )
    if worst > served.bound:
        problems.append(f"/health took {worst:.2f} s (bound {served.bound:.2f} s)")
    assert served.server.proc.poll() is None, "the server died"
    assert not problems, "\n".join(sorted(set(problems)))


def test_a_body_of_one_byte_chunks_is_handled_without_stalling_the_loop(served):
    """A body of 300,000 one-byte chunks (Transfer-Encoding: chunked; h11 makes an event of each,
    handled on the event loop): refused or answered (below 500) within CHUNKS_BOUND seconds, well
    before the body deadline, while /health stays quick and the event loop never stalls longer."""
    served.ready()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        + AUTH.encode()
        + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    text = b'{"prompt": "' + b"a" * (CHUNKS - 31) + b'", "max_tokens": 1}'
    assert len(text) == CHUNKS
    chunks = b"".join(b"1\r\n" + bytes([c]) + b"\r\n" for c in text) + b"0\r\n\r\n"
    stall_before = loop_stall(served.url)
    probe, out = served.probe(), []

    def send():
        with socket.create_connection(("127.0.0.1", served.port)) as s:
            s.settimeout(REQUEST_TIMEOUT)
            try:
                s.sendall(head + chunks)
            except (TimeoutError, BrokenPipeError, ConnectionResetError):
                pass  # refused and closed before the rest was sent
            out.append(closed_within(s, REQUEST_TIMEOUT))
            out.append(time.monotonic())

    start = time.monotonic()
    sender = threading.Thread(target=send)
    sender.start()
    sender.join(2 * REQUEST_TIMEOUT + 5)
    time.sleep(0.5)  # (a probe after the answer: a loop still busy with the rest shows too)
    worst = probe.worst(start, time.monotonic())
    probe.stop()
    answer, took = (out[0], out[1] - start) if len(out) == 2 else (None, time.monotonic() - start)
    problems = []
    if answer is None or not answer.startswith(b"HTTP/1.1 ") or answer[9:10] == b"5":
        problems.append(f"the chunked request got {answer[:200] if answer else 'no answer'!r} in {took:.1f} s")
    elif took > CHUNKS_BOUND:
        problems.append(
            f"the chunked request was answered {answer[:12].decode(errors='replace')!r} after {took:.1f} s "
            f"(bound {CHUNKS_BOUND:.0f} s; the body deadline is {TIMEOUT_BODY:.0f} s)"
        )
    if worst > served.bound:
        problems.append(f"/health took {worst:.2f} s while the chunks came in (bound {served.bound:.2f} s)")
    stall = loop_stall(served.url)
    if stall is not None and stall > max(served.bound, stall_before):
        problems.append(f"the event loop stalled {stall:.2f} s (bound {served.bound:.2f} s)")
    problems += served_normally(served)
    print(
        f"{CHUNKS:,} one-byte chunks: {answer[:12] if answer else None!r} after {took:.1f} s, /health worst "
        f"{worst:.2f} s, longest loop stall {f'{stall:.2f} s' if stall is not None else 'not exposed'}"
    )
    assert served.server.proc.poll() is None, "the server died"
    assert not problems, "\n".join(problems)


def test_slow_readers_lose_their_connections_at_the_write_deadline(served):
    """More clients than --max-connections each ask for an answer larger than the socket buffers
    hold (a 4 KiB receive buffer) and never read it: while they hold every slot, others get 503;
    once the write deadline passes they are dropped, /health answers 200 again within SLACK, and an
    ordinary client is served."""
    served.ready()
    # an answer of ~5 MB: a 404 that names the model asked for (the socket buffers on loopback hold ~3 MB)
    body = json.dumps({"model": "m" * 5_000_000, "tokens": [1]}).encode()
    raw = request("POST", "/detokenize", body)
    with socket.create_connection(("127.0.0.1", served.port)) as s:
        s.settimeout(REQUEST_TIMEOUT)
        s.sendall(raw)
        status, _, answer = read_response(s.makefile("rb"))
    assert status < 500 and len(answer) > 4_500_000, (
        f"the scenario needs an answer larger than the socket buffers; this one is {status}, {len(answer):,} bytes: "
        f"{answer[:200]!r}; pick a request with a larger answer"
    )

    probe, readers, problems = served.probe(), [], []
    start = time.monotonic()
    try:
        for _ in range(MAX_CONNECTIONS + 2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", served.port))
            s.settimeout(REQUEST_TIMEOUT)
            try:
                s.sendall(raw)
            except OSError:
                pass  # (a connection past the cap is answered 503 and closed at once)
            readers.append(s)
        sent = time.monotonic()
        recovered = None  # seconds from `sent` to the first of the 200s /health has answered since
        while recovered is None and time.monotonic() - sent < TIMEOUT_WRITE + SLACK:
            time.sleep(0.25)
            recent = [(t, status) for t, _, status in list(probe.probes) if t >= sent]
            ok = list(itertools.takewhile(lambda p: p[1] == 200, reversed(recent)))
            if len(ok) >= 4:  # answered, and still answering
                recovered = ok[-1][0] - sent
        if recovered is None:
            problems.append(
                f"/health was not answered 200 (and kept answering) within {TIMEOUT_WRITE + SLACK:.0f} s "
                f"of the slow readers' requests (--timeout-write {TIMEOUT_WRITE:.0f})"
            )
        problems += served_normally(served)
        answers = probe.answers(start, time.monotonic())
        again = f"{recovered:.1f} s" if recovered is not None else f"not within {TIMEOUT_WRITE + SLACK:.0f} s"
        timeline = (
            f"the slow readers' requests took {sent - start:.1f} s to send; /health answered 200 again {again} "
            f"after (its answers: {_runs(answers)})"
        )
    finally:
        probe.stop()
        for s in readers:
            s.close()
    print(timeline)
    # (the readers held every slot at some point: /health got a 503)
    assert 503 in answers, f"the slow readers never held every connection slot: the scenario tests nothing ({timeline})"
    assert served.server.proc.poll() is None, "the server died"
    assert not problems, f"{timeline}\n" + "\n".join(problems)


def _runs(statuses: list) -> str:
    """[503, 503, 200] -> '2 x 503, 1 x 200'."""
    out = []
    for s in statuses:
        if out and out[-1][0] == s:
            out[-1][1] += 1
        else:
            out.append([s, 1])
    return ", ".join(f"{n} x {s}" for s, n in out)
