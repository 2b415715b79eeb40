"""Helpers for the server tests: start servers, read /metrics, send chat requests."""

import re
import socket
import threading
import time

import httpx

from irminsul.server.app import create_app
from irminsul.server.config import ServerConfig
from tests.support.services import ThreadServer

WORDS = (
    "policy baggage flight refund cabin upgrade member seat change cancel passenger insurance "
    "reservation economy business gold silver airport delay voucher"
).split()


def text(n_words: int, seed: int) -> str:
    """Deterministic prose (the tiny tokenizer is byte-level: one token per byte)."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def start(model_dir, **overrides) -> ThreadServer:
    """The app on loopback, run by uvicorn as `irminsul serve` runs it."""
    config = ServerConfig(model=str(model_dir), served_model_name="tiny", **overrides)
    return ThreadServer(create_app(config), config=config)


def metric(url: str, name: str, **labels) -> float:
    """Sum of one metric's samples whose labels include ``labels``."""
    total, found = 0.0, False
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total, found = total + float(m.group(3)), True
    assert found, f"no sample of {name} {labels} in /metrics"
    return total


def chat(url: str, messages, max_tokens: int = 4, headers=None, **extra) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def loop_stall(url: str) -> float | None:
    """The server's longest event-loop stall so far (irminsul_event_loop_stall_seconds_max), None
    where its /metrics has no such gauge."""
    found = re.findall(
        r"^irminsul_event_loop_stall_seconds_max(?:\{[^}]*\})?\s+(\S+)$",
        httpx.get(url + "/metrics", timeout=30).text,
        re.M,
    )
    return max(map(float, found)) if found else None


class HealthProbe:
    """GET /health every `period` seconds, each on a fresh connection, from a thread of its own: how
    long each took and what it answered (None: no answer within `timeout`)."""

    def __init__(self, url: str, period: float = 0.25, timeout: float = 30.0):
        self.url, self.period, self.timeout = url, period, timeout
        self.probes: list[tuple[float, float | None, int | None]] = []  # (start, seconds, status)
        self.current: float | None = None  # the start of the probe in flight
        self.started = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def start(self) -> "HealthProbe":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(self.timeout + 5)

    def _run(self) -> None:
        while not self._done.is_set():
            start = self.current = time.monotonic()
            try:
                status = httpx.get(self.url + "/health", timeout=self.timeout).status_code
            except httpx.HTTPError:
                status = None
            self.probes.append((start, time.monotonic() - start, status))
            self.current = None
            self._done.wait(self.period)

    def worst(self, start: float, end: float) -> float:
        """The slowest probe in flight at any time in [start, end] (one still in flight: so far)."""
        spans = [(s, s + d) for s, d, _ in list(self.probes)]
        if (current := self.current) is not None:
            spans.append((current, time.monotonic()))
        return max((e - s for s, e in spans if s < end and e > start), default=0.0)

    def answers(self, start: float, end: float) -> list[int | None]:
        """The statuses of the probes that started in [start, end]."""
        return [status for s, _, status in list(self.probes) if start <= s <= end]

    def quick(self, bound: float, timeout: float) -> bool:
        """Wait until a probe that starts from now answers 200 within `bound` seconds; False if none
        has within `timeout`."""
        since, end = time.monotonic(), time.monotonic() + timeout
        while time.monotonic() < end:
            if any(s >= since and d <= bound and status == 200 for s, d, status in list(self.probes)):
                return True
            time.sleep(0.05)
        return False


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing, or None if it still holds the connection after `seconds`."""
    sock.settimeout(seconds)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return out


def health_status(url: str) -> int | str:
    """/health's status code, or what went wrong asking for it."""
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
