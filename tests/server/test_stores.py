"""Stores under a real server: replicas share Redis, Redis outages are survived, corrupt disk entries recomputed."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from irminsul.kvcache.store import StoreConfig
from irminsul.kvcache.store.codec import decode
from tests.server.server_helpers import chat, metric, start, text
from tests.support.services import ServerProcess, wait_for


def turn(header: str, doc: str) -> list:
    return [{"role": "system", "content": header}, {"role": "user", "content": doc}]


def test_two_replicas_share_one_redis(tiny_dir, redis_proc):
    args = ("--model", str(tiny_dir), "--served-model-name", "tiny", "--store", redis_proc.url)
    a, b = ServerProcess(*args), ServerProcess(*args)
    try:
        doc = text(150, 40)
        chat(a.url, turn("replica a, request 1", doc))
        wait_for(
            lambda: (
                metric(a.url, "irminsul_store_pending_writes", tier="redis") == 0
                and metric(a.url, "irminsul_store_insertions_total", tier="redis") > 0
            ),
            10,
            "A's writes to Redis",
        )
        got = chat(b.url, turn("replica b sees the document at another position", doc))["usage"]["irminsul"]
        assert got["reused_tokens"] > 0.7 * len(doc), got
        assert metric(b.url, "irminsul_store_hits_total", tier="redis") > 0
    finally:
        a.stop(), b.stop()


def test_redis_outage_is_survived_and_reconnected(tiny_dir, redis_proc):
    s = start(tiny_dir, store=StoreConfig(("memory", redis_proc.url)))
    try:
        doc = text(120, 50)
        before = chat(s.url, turn("h1", doc), max_tokens=6)
        redis_proc.stop()
        for i in range(3):  # new content misses memory and would ask Redis: it must not hang or fail
            chat(s.url, turn(f"outage {i}", text(80, 60 + i)))
        again = chat(s.url, turn("h1", doc), max_tokens=6)
        assert again["choices"][0]["message"] == before["choices"][0]["message"]
        wait_for(lambda: metric(s.url, "irminsul_store_failures_total", tier="redis") >= 1, 10, "a counted failure")
        assert metric(s.url, "irminsul_store_available", tier="redis") == 0
        redis_proc.start()  # back, empty, on the same port
        wait_for(lambda: metric(s.url, "irminsul_store_available", tier="redis") == 1, 20, "the reconnect")
        chat(s.url, turn("after", text(80, 70)))
        wait_for(lambda: redis_proc.client().dbsize() > 0, 10, "writes to the new Redis")
    finally:
        s.stop()


def test_corrupt_disk_entry_is_detected_and_recomputed(tiny_dir, tmp_path):
    store = StoreConfig(("memory", f"disk:{tmp_path}"))
    doc = text(150, 80)
    s = start(tiny_dir, store=store)
    try:
        chat(s.url, turn("first run", doc))
    finally:
        s.stop()
    from safetensors.torch import load

    def inside_doc(f):  # the tiny tokenizer maps bytes to ids 0..255
        ids = load(f.read_bytes())["token_ids"].tolist()
        piece = bytes(ids).decode() if max(ids) < 256 else ""
        return piece and piece in doc and not doc.endswith(piece)

    files = sorted(f for f in tmp_path.glob("*/*/*.safetensors") if inside_doc(f))
    assert len(files) >= 3
    victim = files[1]
    data = bytearray(victim.read_bytes())
    data[-20] ^= 0xFF  # a flipped bit in the rows: only the checksum can tell
    victim.write_bytes(bytes(data))

    s = start(tiny_dir, store=store)  # a restart: the memory tier is empty, the disk index is rebuilt
    try:
        got = chat(s.url, turn("second run, another position", doc))["usage"]["irminsul"]
        assert got["reused_tokens"] > 0.5 * len(doc), got
        assert metric(s.url, "irminsul_store_corrupt_total", tier="disk") == 1
        assert metric(s.url, "irminsul_store_hits_total", tier="disk") >= 3
        layout = s.app.state.irminsul.client.registry.lower[0].layout
        decode(victim.read_bytes(), layout)  # recomputed and written back, valid again
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()


def test_a_store_filled_by_another_checkpoint_gives_no_hits_and_loses_nothing(tiny_dir, tmp_path):
    """A copy of the model with one matrix's rows shuffled (same names, same sizes) once shared the
    original's namespace: it took the original's rows and answered wrongly."""
    from tests.checkpoints import rows_reversed_copy

    shuffled = rows_reversed_copy(tiny_dir, tmp_path / "shuffled")
    store = StoreConfig(("memory", f"disk:{tmp_path / 'store'}"))
    doc = text(150, 90)
    s = start(tiny_dir, store=store)
    try:
        chat(s.url, turn("original, first", doc))
        s.app.state.irminsul.client.registry.flush()
    finally:
        s.stop()
    files = sorted((tmp_path / "store").rglob("*.safetensors"))
    assert files
    s = start(shuffled, store=store)
    try:
        got = chat(s.url, turn("the copy, at another position", doc))["usage"]["irminsul"]
        assert got["reused_tokens"] == 0 and metric(s.url, "irminsul_store_hits_total", tier="disk") == 0
    finally:
        s.stop()
    assert all(f.exists() for f in files)  # nothing of the original's was deleted


def test_a_store_shared_under_another_secret_is_neither_served_nor_deleted(tiny_dir, tmp_path, monkeypatch):
    from irminsul.cli import build_parser
    from irminsul.server.cli import config_from_args

    store = StoreConfig(("memory", f"disk:{tmp_path}"))
    doc = text(150, 95)
    s = start(tiny_dir, store=store, store_secret="alpha")
    try:
        chat(s.url, turn("first, under alpha", doc))
        s.app.state.irminsul.client.registry.flush()
    finally:
        s.stop()
    files = sorted(tmp_path.rglob("*.safetensors"))
    for secret, hits in (("beta", False), ("alpha", True)):
        s = start(tiny_dir, store=store, store_secret=secret)
        try:
            got = chat(s.url, turn(f"again under {secret}, elsewhere", doc))["usage"]["irminsul"]
            assert (got["reused_tokens"] > 0.5 * len(doc)) is hits, (secret, got)
            assert metric(s.url, "irminsul_store_corrupt_total", tier="disk") == 0
        finally:
            s.stop()
        assert all(f.exists() for f in files)
    # the CLI maps the environment variable explicitly; the flag wins over it
    monkeypatch.setenv("IRMINSUL_STORE_SECRET", "from-env")
    assert config_from_args(build_parser().parse_args(["serve"])).store_secret == "from-env"
    assert config_from_args(build_parser().parse_args(["serve", "--store-secret", "x"])).store_secret == "x"


def stream_chat(url: str, messages) -> tuple[str, str, dict]:
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces, reason, usage = [], None, {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                pieces.append(chunk["choices"][0]["delta"].get("content") or "")
                reason = chunk["choices"][0]["finish_reason"] or reason
            usage = chunk.get("usage") or usage
    return "".join(pieces), reason, usage


def test_a_disk_that_turns_read_only_mid_run_costs_no_request(tiny_dir, tmp_path, monkeypatch):
    """The disk tier's directory becomes read-only while the server runs: streams keep completing,
    reads still hit, every refused touch and write is counted and the log stays short."""
    from tests.kvcache.store.test_faults import DiskFaults

    s = start(tiny_dir, store=StoreConfig(("memory", f"disk:{tmp_path}")))
    try:
        docs = [text(120, 300 + i) for i in range(3)]
        before = [stream_chat(s.url, turn(f"before {i}", doc)) for i, doc in enumerate(docs)]
        state = s.app.state.irminsul
        assert state.client.registry.flush()
        state.client.call(state.client.engine.kv.clear).result(10)  # memory forgets: the disk must answer
        DiskFaults(monkeypatch, tmp_path).mode = "read-only"
        prompts = [turn(f"before {i}", doc) for i, doc in enumerate(docs)] + [
            turn(f"new {i}", text(100, 400 + i)) for i in range(3)
        ]
        with ThreadPoolExecutor(4) as pool:
            after = list(pool.map(lambda m: stream_chat(s.url, m), prompts * 2))
        assert all(reason in ("stop", "length") for _, reason, _ in after)
        assert [a[0] for a in after[:3]] == [b[0] for b in before]
        assert metric(s.url, "irminsul_store_hits_total", tier="disk") > 0  # a read-only disk still serves
        assert metric(s.url, "irminsul_store_failures_total", tier="disk") > 0
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()


def test_an_unreachable_redis_at_start_up_is_said_once(tiny_dir, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="irminsul.server"):
        s = start(tiny_dir, store=StoreConfig(("memory", "redis://127.0.0.1:1/0")))
    try:
        said = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
        assert len(said) == 1 and "redis://127.0.0.1:1/0" in said[0], said
        assert chat(s.url, [{"role": "user", "content": "hello"}], max_tokens=2)["choices"]  # served without it
    finally:
        s.stop()
