"""Helpers for the server tests: start servers, read /metrics, send chat requests."""

import re

import httpx

from irminsul.server.app import create_app
from irminsul.server.config import ServerConfig
from irminsul.server.testing import ThreadServer

WORDS = ("policy baggage flight refund cabin upgrade member seat change cancel passenger insurance "
         "reservation economy business gold silver airport delay voucher").split()


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
