"""Hostile request SIZES against a live keyed server while another tenant streams: long item lists in
every list-valued field and long maps in every map-valued field of every endpoint, each as long as
the body limit (--max-request-bytes) lets it be, plus the shapes that make one item cost as much
as all before it (function_call outputs that each name the first of thousands of calls, tool
schemas of 20 x 400 properties x 50-value enums, a logit_bias on every token with n=8).

Work that grows with a request's size must not run on the event loop (it holds every other
request, /health included), must not run for as long as the body allows before the request is
refused, and must not take the engine from the other tenant. For each request the run checks:

- an answer below 500 within REQUEST_TIMEOUT, and no larger than a request may be;
- /health, probed every 0.25 s from its own thread, never slower than max(1 s, 4x its latency in
  the idle phase), and the longest event-loop stall (the server's
  irminsul_event_loop_stall_seconds_max gauge, where it exposes one) within the same bound;
- the other tenant's streams never more than 3x as long as its stream alone just before the
  request (or at the start, whichever was slower: others may load the machine meanwhile);
- the server alive at the end.

The server runs in its own process (`irminsul serve`), so an input that crashes it is reported
as the input after which it died. Every failure is collected, so one run lists them all, with a
table of what each request measured.
"""

import itertools
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx

from irminsul.model.tokenizer import Tokenizer
from irminsul.server.config import ServerConfig
from tests.server.server_helpers import HealthProbe, health_status, loop_stall
from tests.support.services import ServerProcess, rss_mib

ALICE, BOB, ADMIN = "alice-key", "bob-key", "admin-key"  # alice sends the sizes, bob streams
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
BODY_LIMIT = ServerConfig().max_request_bytes  # the server below runs with the default
FILL = int(BODY_LIMIT * 0.95)  # "as long as the body allows": this many bytes, just under the limit
REQUEST_TIMEOUT, REQUEST_TIMES_ALONE = 20.0, 20.0  # one answer may take the longer of 20 s and 20 of bob's
# streams alone (a loaded machine runs everything slower); longer is a stall, reported as a failure
SETTLE_TIMEOUT = 30.0  # seconds the server may take to be quick again after an answer
CORPUS_BUDGET = 150.0  # seconds for all the sizes; the run stops there and says how far it got
HEALTH_FLOOR, HEALTH_TIMES_IDLE, STREAM_TIMES_ALONE = 1.0, 4.0, 3.0
# tokens of each of bob's streams (ignore_eos: every stream is as long): long enough (0.5-1.5 s where the native
# decode step runs, longer without it) that reading a body at the limit (~0.5 s of JSON parsing that holds the
# GIL) is not a slowdown of 3x by itself
B_TOKENS = 768


# -- the sizes -------------------------------------------------------------------------------------

HOLE = "@@items@@"  # where at_limit puts the items in a body


def at_limit(body: dict, items, brackets: str = "[]", room: int = FILL) -> tuple[int, bytes]:
    """(n, JSON text) of `body` with its HOLE filled by as many of `items` as fit in `room` bytes:
    a list (brackets "[]") or a map ("{}") whose items are JSON texts (values, or '"key": value'
    pairs), `items` one text repeated or an iterable of them. (Text, not json.dumps of a million
    objects: built in milliseconds.)"""
    text = json.dumps(body)
    assert text.count(f'"{HOLE}"') == 1, text
    room -= len(text) - len(f'"{HOLE}"') + 2
    if isinstance(items, str):
        n = max(0, (room + 2) // (len(items) + 2))
        inner = ", ".join([items] * n)
    else:
        pieces, used = [], -2
        for item in items:
            if used + len(item) + 2 > room:
                break
            pieces.append(item)
            used += len(item) + 2
        n, inner = len(pieces), ", ".join(pieces)
    return n, text.replace(f'"{HOLE}"', brackets[0] + inner + brackets[1]).encode()


def spellings(vocab: int):
    """Distinct JSON keys that int() reads as ids in [0, vocab): leading and trailing spaces, a sign
    and leading zeros around each id, so a logit_bias map can hold hundreds of thousands of entries
    that all name real tokens."""
    for pad in range(12):
        for zeros in range(9):
            for trail in range(12):
                for sign in ("", "+"):
                    for t in range(vocab):
                        yield f"{' ' * pad}{sign}{'0' * zeros}{t}{' ' * trail}"


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields}


def responses(**fields) -> dict:
    return {"model": "tiny", "input": "hi", "max_output_tokens": 4, **fields}


def enum_tools(tools: int = 20, properties: int = 400, values: int = 50, responses_api: bool = False) -> list:
    enum = [f"value{v:02d}" for v in range(values)]
    params = {"type": "object", "properties": {f"p{p}": {"type": "string", "enum": enum} for p in range(properties)}}
    if responses_api:
        return [{"type": "function", "name": f"tool{t}", "parameters": params} for t in range(tools)]
    return [{"type": "function", "function": {"name": f"tool{t}", "parameters": params}} for t in range(tools)]


def call_outputs_of_the_first_call(n: int) -> list:
    """n function_call items (call ids c0 ... c{n-1}), then n function_call_output items, all for c0."""
    calls = [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in range(n)]
    return calls + [{"type": "function_call_output", "call_id": "c0", "output": "x"}] * n


def longest_token(tokenizer: Tokenizer) -> int:
    return max(range(tokenizer.vocab_size), key=lambda t: len(tokenizer.token_bytes(t, False)))


def sized(tokenizer: Tokenizer) -> list[tuple[str, str, dict, object, str]]:
    """(what, path, body, items, brackets) for every list- and map-valued field of every endpoint
    (at_limit's arguments)."""
    vocab, word = tokenizer.vocab_size, longest_token(tokenizer)
    text = json.dumps
    names = lambda value: (f'"k{i}": {value}' for i in itertools.count())  # noqa: E731
    user, tool = text({"role": "user", "content": "a"}), {"type": "function", "function": {"name": "f"}}
    return [
        ("responses metadata, streamed", RESPONSES, responses(stream=True, metadata=HOLE), names('"v"'), "{}"),
        ("completions prompts", COMPLETIONS, completion(prompt=HOLE), text("a"), "[]"),
        ("completions token-id prompts", COMPLETIONS, completion(prompt=HOLE), "[5]", "[]"),
        (
            "tokenize messages",
            "/tokenize",
            {"model": "tiny", "messages": HOLE},
            text({"role": "user", "content": ""}),
            "[]",
        ),
        ("detokenize tokens", "/detokenize", {"model": "tiny", "tokens": HOLE}, str(word), "[]"),
        ("chat messages", CHAT, chat(messages=HOLE), user, "[]"),
        ("chat stop", CHAT, chat(stop=HOLE), text("ab"), "[]"),
        ("completions stop_token_ids", COMPLETIONS, completion(stop_token_ids=HOLE), "5", "[]"),
        (
            "chat logit_bias spellings of real ids",
            CHAT,
            chat(logit_bias=HOLE),
            (f"{text(k)}: 1" for k in spellings(vocab)),
            "{}",
        ),
        ("chat tools", CHAT, chat(tools=HOLE), text(tool), "[]"),
        ("responses tools", RESPONSES, responses(tools=HOLE), text({"type": "function", "name": "f"}), "[]"),
        (
            "tokenize tools",
            "/tokenize",
            {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "tools": HOLE},
            text(tool),
            "[]",
        ),
        (
            "chat tool parameters' properties",
            CHAT,
            chat(
                tools=[
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "properties": HOLE}},
                    }
                ]
            ),
            names('{"type": "string"}'),
            "{}",
        ),
        ("chat chat_template_kwargs", CHAT, chat(chat_template_kwargs=HOLE), names("1"), "{}"),
        (
            "chat content parts",
            CHAT,
            chat(messages=[{"role": "user", "content": HOLE}]),
            text({"type": "text", "text": "a"}),
            "[]",
        ),
        (
            "chat tool_calls of one message",
            CHAT,
            chat(
                messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": HOLE}]
            ),
            text({"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}),
            "[]",
        ),
        ("chat guided_choice", CHAT, chat(guided_choice=HOLE), (f'"c{i}"' for i in itertools.count()), "[]"),
        ("completions one token-id prompt", COMPLETIONS, completion(prompt=HOLE), "5", "[]"),
        (
            "responses input messages",
            RESPONSES,
            responses(input=HOLE),
            text({"type": "message", "role": "user", "content": "a"}),
            "[]",
        ),
        (
            "responses input content parts",
            RESPONSES,
            responses(input=[{"type": "message", "role": "user", "content": HOLE}]),
            text({"type": "input_text", "text": "a"}),
            "[]",
        ),
        ("responses include", RESPONSES, responses(include=HOLE), text("message.output_text.logprobs"), "[]"),
        ("publish token_ids", "/v1/cache/chunks", {"model": "tiny", "token_ids": HOLE}, "5", "[]"),
    ]


def corpus(tokenizer: Tokenizer):
    """(what, path, build) for every size; `build()` makes the body (outside the measured time)."""
    every = {str(t): 1 for t in range(tokenizer.vocab_size)}
    whole = lambda n, body: (n, json.dumps(body).encode())  # noqa: E731
    return [
        # outputs that all name the first of thousands of calls: quadratic where each output looks its call up
        # among all the calls before it
        (
            "responses input: 8,000 calls, 8,000 outputs for the first",
            RESPONSES,
            lambda: whole(8000, responses(input=call_outputs_of_the_first_call(8000))),
        ),
        # schemas a template renders into millions of prompt tokens: counted before they are tokenized?
        ("chat tools: 20 x 400 properties x 50-value enums", CHAT, lambda: whole(20, chat(tools=enum_tools()))),
        (
            "responses tools: 20 x 400 properties x 50-value enums",
            RESPONSES,
            lambda: whole(20, responses(tools=enum_tools(responses_api=True))),
        ),
        # a bias on every token of every choice: work at every engine step, the other tenant's steps too
        (
            "chat logit_bias on every token, n=8",
            CHAT,
            lambda: whole(len(every), chat(logit_bias=every, n=8, max_tokens=128, ignore_eos=True, temperature=1)),
        ),
    ] + [(what, path, lambda args=args: at_limit(*args)) for what, path, *args in sized(tokenizer)]


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class Stream:
    start: float
    end: float
    outcome: str  # "length" when it ran to its max_tokens, else what went wrong


class Streamer(threading.Thread):
    """The other tenant: streams of B_TOKENS sampled tokens, one after another, until told to stop."""

    def __init__(self, url: str):
        super().__init__(name="bob-streams", daemon=True)
        self.url, self.done, self.streams = url, threading.Event(), []

    def run(self):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Tell me about baggage."}],
            "max_tokens": B_TOKENS,
            "temperature": 1,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT * 3, connect=5)) as client:
            while not self.done.is_set():
                start = time.monotonic()
                outcome = self._one(client, body)
                self.streams.append(Stream(start, time.monotonic(), outcome))

    def _one(self, client, body) -> str:
        try:
            with client.stream("POST", self.url + CHAT, json=body, headers={"Authorization": f"Bearer {BOB}"}) as r:
                events = r.read()
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"
        # (read as bytes: a sampled text may hold U+2028 and the like, where a line reader would split an event)
        if r.status_code != 200 or b'data: {"error"' in events or not events.endswith(b"data: [DONE]\n\n"):
            return f"status {r.status_code}: {events[-300:]!r}"
        return "length" if b'"finish_reason": "length"' in events else f"no finish_reason 'length': {events[-300:]!r}"

    def during(self, start: float, end: float) -> list[Stream]:
        return [s for s in list(self.streams) if s.start < end and s.end > start]

    def alone(self, timeout: float) -> Stream | None:
        """Wait for a whole stream that starts from now (the next case waits for it: bob alone, on the
        machine as loaded as it is now); None if none ends within `timeout`."""
        since, end = time.monotonic(), time.monotonic() + timeout
        while time.monotonic() < end:
            if started := [s for s in list(self.streams) if s.start >= since]:
                return started[0]
            time.sleep(0.02)
        return None

    def past(self, t: float, timeout: float) -> bool:
        """Wait until the stream running at time `t` has ended; False if it has not within `timeout`."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(s.end > t for s in list(self.streams)):
                return True
            time.sleep(0.05)
        return False


@dataclass
class Measured:
    what: str
    n: int
    mib: float
    status: int | None = None
    answer: str = ""
    seconds: float = 0.0
    health: float = 0.0  # the slowest /health during the request and until the server was quick again
    stream_ratio: float = 0.0  # the slowest of bob's streams then, over bob's stream alone just before
    alone: float = 0.0  # that stream alone: the longer of the one before this request and those at the start
    stall: float | None = None  # the server's longest event-loop stall so far, where it reports one
    rss: int = 0  # the server's resident memory after it (MiB)
    problems: list = field(default_factory=list)

    def row(self) -> str:
        stall = "-" if self.stall is None else f"{self.stall:.2f}"
        return (
            f"{self.what[:58]:58} n={self.n:<8} {self.mib:5.2f} MiB  {self.status or 'none'}  "
            f"{self.seconds:5.1f} s  /health {self.health:5.2f} s  bob x{self.stream_ratio:4.1f} of "
            f"{self.alone:.2f} s  stall {stall}  rss {self.rss} MiB  {self.answer[:90]!r}"
        )


def send(client: httpx.Client, url: str, path: str, content: bytes, timeout: float) -> tuple[int | None, int, str]:
    """(status, the answer's size, what it says), or (None, 0, what went wrong)."""
    key = ADMIN if path == "/v1/cache/chunks" else ALICE
    try:
        r = client.post(
            url + path,
            content=content,
            timeout=httpx.Timeout(timeout, connect=5),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        return r.status_code, len(r.content), f"{len(r.content):,} bytes: {r.text[:160]}"
    except httpx.TimeoutException as e:
        return None, 0, f"no answer in {timeout:.0f} s ({type(e).__name__})"
    except httpx.TransportError as e:
        return None, 0, f"{type(e).__name__}: {e}"


class Run:
    """The server, the /health probe and bob's streams, and the bounds measured before the sizes."""

    def __init__(self, server: ServerProcess):
        self.server, self.probe, self.streamer = server, HealthProbe(server.url), Streamer(server.url)
        self.probe.start()
        self.streamer.start()
        while len(self.streamer.streams) < 4:  # bob alone (the first stream warms up, and is left out)
            time.sleep(0.05)
            assert server.proc.poll() is None and time.monotonic() - self.probe.started < 120, "bob never streamed"
        first = self.streamer.streams[:4]
        assert all(s.outcome == "length" for s in first), [s.outcome for s in first]
        self.alone = statistics.median(s.end - s.start for s in first[1:])
        self.idle = self.probe.worst(first[1].start, time.monotonic())
        self.bound = max(HEALTH_FLOOR, HEALTH_TIMES_IDLE * self.idle)
        self.timeout = max(REQUEST_TIMEOUT, REQUEST_TIMES_ALONE * self.alone)
        self.stall_before = loop_stall(server.url)
        self.client = httpx.Client()

    def stop(self) -> None:
        self.streamer.done.set()
        self.probe.stop()
        self.client.close()

    def measure(self, what: str, path: str, n: int, content: bytes, earlier: list[Measured]) -> Measured:
        m = Measured(f"{what} ({path})", n, len(content) / 2**20)
        before = self.streamer.alone(SETTLE_TIMEOUT)
        m.alone = max(self.alone, before.end - before.start if before and before.outcome == "length" else 0.0)
        t0 = time.monotonic()
        m.status, size, m.answer = send(self.client, self.server.url, path, content, self.timeout)
        t1 = time.monotonic()
        m.seconds = t1 - t0
        # the request's window runs on until /health is quick again and bob's stream then has ended
        settled = self.probe.quick(self.bound, SETTLE_TIMEOUT) and self.streamer.past(t1, SETTLE_TIMEOUT)
        t2 = time.monotonic()
        m.health = self.probe.worst(t0, t2)
        during = self.streamer.during(t0, t2)
        m.stream_ratio = max((s.end - s.start for s in during), default=0.0) / m.alone
        m.stall, m.rss = loop_stall(self.server.url), rss_mib(self.server.proc.pid)
        if m.status is None or m.status >= 500:
            m.problems.append(f"answered {m.status or 'nothing'}: {m.answer}")
        if size > BODY_LIMIT:
            m.problems.append(f"the answer is {size:,} bytes, more than a request may be ({BODY_LIMIT:,})")
        if m.health > self.bound:
            m.problems.append(f"/health took {m.health:.2f} s (bound {self.bound:.2f} s)")
        if m.stream_ratio > STREAM_TIMES_ALONE:
            m.problems.append(
                f"bob's stream took {m.stream_ratio:.1f}x as long as alone ({m.alone:.2f} s alone; "
                f"bound {STREAM_TIMES_ALONE:.0f}x)"
            )
        if bad := [s.outcome for s in during if s.outcome != "length"]:
            m.problems.append(f"bob's streams ended with {bad[:3]}")
        previous = max([self.stall_before or 0.0] + [r.stall or 0.0 for r in earlier])
        if m.stall is not None and m.stall > max(self.bound, previous):
            m.problems.append(f"the event loop stalled {m.stall:.2f} s (bound {self.bound:.2f} s)")
        if not settled:
            m.problems.append(f"the server was not quick again {SETTLE_TIMEOUT:.0f} s after the answer")
        return m


def test_requests_as_large_as_the_body_limit_stall_nothing(tiny_dir, monkeypatch):
    # the model's products on one thread: on a shared machine OpenMP threads that wait at a barrier for a
    # descheduled sibling make a stream's time vary 20x, which would drown the slowdowns measured here
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cases = corpus(Tokenizer(tiny_dir))
    server = ServerProcess(
        "--model",
        str(tiny_dir),
        "--served-model-name",
        "tiny",
        "--api-key",
        f"{ALICE}=alice",
        "--api-key",
        f"{BOB}=bob",
        "--admin-key",
        ADMIN,
        "--default-max-tokens",
        "4",
        "--no-compile-decode",
        "--log-level",
        "warning",
    )
    failures, results, run = [], [], None
    try:
        run = Run(server)
        if run.stall_before is not None and run.stall_before > run.bound:
            failures.append(
                f"the event loop stalled {run.stall_before:.2f} s before any large request (bound {run.bound:.2f} s)"
            )
        end = time.monotonic() + CORPUS_BUDGET
        for what, path, build in cases:
            if time.monotonic() > end:
                failures.append(
                    f"the sizes took over {CORPUS_BUDGET:.0f} s: {len(results)} of {len(cases)} sent; "
                    f"not sent: {', '.join(what for what, _, _ in cases[len(results) :])}"
                )
                break
            n, content = build()
            assert len(content) <= BODY_LIMIT, (what, len(content))
            m = run.measure(what, path, n, content, results)
            results.append(m)
            failures += [f"{m.what}, n={n:,}: {p}" for p in m.problems]
            if server.proc.poll() is not None:
                failures.append(f"the server died (exit status {server.proc.returncode}) after: {m.what}")
                break
        if server.proc.poll() is None:
            health = health_status(server.url)
            if health != 200:
                failures.append(f"/health answers {health} after the sizes")
    finally:
        if run is not None:
            run.stop()
        alive = server.proc.poll() is None
        server.stop()
    stalls = [r.stall for r in results if r.stall is not None]
    table = "\n".join(m.row() for m in results)
    summary = (
        f"idle /health {run.idle:.3f} s (bound {run.bound:.2f} s), bob alone {run.alone:.2f} s for "
        f"{B_TOKENS} tokens, longest event-loop stall "
        f"{f'{max(stalls):.2f} s' if stalls else 'not exposed by this server'}"
    )
    log = server.log.read_text(errors="replace")
    died = f"\nthe end of its log:\n{log[-2000:]}" if not alive else ""
    print(f"\n{summary}\n{table}")
    assert not failures, (
        f"{len(failures)} failures in {len(results)} large requests; {summary}; "
        f"{log.count('Traceback (most recent call last)')} tracebacks in the server log "
        f"{server.log}:\n" + "\n".join(failures) + f"\n\nevery request:\n{table}{died}"
    )
