"""Store tiers that fail never hurt serving: a failing tier is a miss or a skipped write, counted in
its stats and logged at most once per interval, never an error on the engine thread.

Disk faults are injected by monkeypatching the file operations under the store's directory (as
root, chmod stops nothing); Redis faults by patching the client or configuring a real redis-server.
"""

import errno
import json
import logging
import os
import pathlib
import struct
import time

import numpy as np
import pytest
import torch

from irminsul.kvcache.registry import Entry, MemoryRegistry, Registry
from irminsul.kvcache.store import RowLayout, StoreConfig, open_registry, tier_stats
from irminsul.kvcache.store.disk import DiskRegistry
from irminsul.kvcache.store.redis import RedisRegistry
from irminsul.kvcache.store.tiered import TieredRegistry
from tests.kvcache.store.conftest import LAYOUT
from tests.support.services import RedisProcess

DISK_FAULTS = ("read-only", "full", "slow", "failing", "vanishing", "denied")


def entry(fp, n=8, seed=0):
    rows = torch.randn(2, n, 6, generator=torch.Generator().manual_seed(seed))
    return Entry(fp, np.arange(seed, seed + n, dtype=np.int64), 0, rows, rows.numel() * 4)


def ids(seed, n=8):
    return np.arange(seed, seed + n, dtype=np.int64)


class DiskFaults:
    """File operations under `root` fail as a failing disk's do, from the moment `mode` is set:
    read-only (EROFS on every change), full (ENOSPC half-way through a write), slow, failing (EIO on
    everything), vanishing (files removed just before they are read), denied (EACCES on reads)."""

    def __init__(self, monkeypatch, root):
        self.root, self.mode, self.injected = str(root), None, 0
        real = {name: getattr(pathlib.Path, name) for name in ("write_bytes", "unlink", "iterdir")}
        real_open, real_utime, real_replace = os.open, os.utime, os.replace

        def ours(path) -> bool:
            return self.mode is not None and str(path).startswith(self.root)

        def fail(code):
            self.injected += 1
            raise OSError(code, os.strerror(code))

        def open_(path, *args, **kwargs):  # (the tier opens entries with os.open to read them)
            if ours(path):
                if self.mode == "slow":
                    time.sleep(0.005)
                elif self.mode == "failing":
                    fail(errno.EIO)
                elif self.mode == "denied":
                    self.injected += 1
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
                elif self.mode == "vanishing":
                    real["unlink"](pathlib.Path(path), missing_ok=True)
            return real_open(path, *args, **kwargs)

        def write_bytes(path, data):
            if ours(path):
                if self.mode in ("read-only", "failing"):
                    fail(errno.EROFS if self.mode == "read-only" else errno.EIO)
                if self.mode == "full":
                    real["write_bytes"](path, data[: len(data) // 2])  # what fitted before the disk filled
                    fail(errno.ENOSPC)
                if self.mode == "slow":
                    time.sleep(0.005)
            return real["write_bytes"](path, data)

        def unlink(path, missing_ok=False):
            if ours(path) and self.mode in ("read-only", "failing"):
                fail(errno.EROFS if self.mode == "read-only" else errno.EIO)
            return real["unlink"](path, missing_ok=missing_ok)

        def iterdir(path):
            if ours(path) and self.mode == "failing":
                fail(errno.EIO)
            return real["iterdir"](path)

        def utime(path, *args, **kwargs):
            if ours(path) and self.mode in ("read-only", "failing"):
                fail(errno.EROFS if self.mode == "read-only" else errno.EIO)
            return real_utime(path, *args, **kwargs)

        def replace(src, dst, *args, **kwargs):
            if ours(dst) and self.mode in ("read-only", "failing", "full"):
                fail({"read-only": errno.EROFS, "failing": errno.EIO, "full": errno.ENOSPC}[self.mode])
            return real_replace(src, dst, *args, **kwargs)

        for name, fn in (("write_bytes", write_bytes), ("unlink", unlink), ("iterdir", iterdir)):
            monkeypatch.setattr(pathlib.Path, name, fn)
        for name, fn in (("open", open_), ("utime", utime), ("replace", replace)):
            monkeypatch.setattr(os, name, fn)


class Raising(Registry):
    """A tier of another kind that raises on every call."""

    def get(self, *args):
        raise RuntimeError("the tier is broken")

    peek = put = pin = unpin = __contains__ = get

    def __len__(self):
        return 0

    @property
    def stats(self):
        raise RuntimeError("the tier is broken")


def store_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "irminsul.store"]


# -- the disk tier on its own -------------------------------------------------------------------


@pytest.mark.parametrize("mode", DISK_FAULTS)
def test_a_failing_disk_is_a_miss_or_a_skipped_write_never_an_error(tmp_path, monkeypatch, caplog, mode):
    disk = DiskRegistry(tmp_path, LAYOUT, budget_bytes=1 << 20)
    for i in range(4):
        assert disk.put(entry(10 + i, seed=i))
    faults = DiskFaults(monkeypatch, tmp_path)
    faults.mode = mode
    with caplog.at_level(logging.WARNING, logger="irminsul.store"):
        for _ in range(50):  # bounded: every lookup and write of a serving loop, many times over
            got = [disk.get(10 + i, ids(i)) for i in range(4)]
            assert disk.get(99, ids(0)) is None and disk.peek(98) is None
            for i in range(3):
                disk.put(entry(20 + i, seed=i))
            disk.pin(10), disk.unpin(10)
            assert disk.stats.entries <= 7 and disk.tier_stats.failures >= 0
        if mode in ("slow", "vanishing", "denied"):  # (a disk that takes no writes is refused at start)
            DiskRegistry(tmp_path, LAYOUT, budget_bytes=1 << 20).get(10, ids(0))  # the index loads regardless
    s = disk.tier_stats
    if mode in ("read-only", "slow"):
        assert all(e is not None for e in got), mode  # what it holds is still served
    if mode == "vanishing":
        assert all(e is None for e in got) and s.failures == 0  # a removed file is a miss, not a failure
    elif mode != "slow":
        assert faults.injected and s.failures > 0, (mode, s)
    assert s.corrupt == 0, s  # an I/O error says nothing about the entry: never counted as corrupt
    assert not list(tmp_path.rglob("*.tmp")), "a failed write left its temporary file"
    lines = store_lines(caplog)
    assert len(lines) <= 2, lines  # one per tier instance per interval (two DiskRegistry objects here)
    faults.mode = None
    if mode in ("denied", "failing"):
        assert disk.get(10, ids(0)) is not None  # an unreadable file was not dropped: served once readable


def test_a_full_disk_leaves_no_temporary_files_behind(tmp_path, monkeypatch):
    """A budget larger than the filesystem: every write fails half-way, none leaves bytes behind."""
    disk = DiskRegistry(tmp_path, LAYOUT, budget_bytes=1 << 30)
    DiskFaults(monkeypatch, tmp_path).mode = "full"
    for i in range(20):
        assert not disk.put(entry(100 + i, seed=i))
    assert not list(tmp_path.rglob("*.tmp")) and len(disk) == 0
    s = disk.tier_stats
    assert s.failures == 20 and s.dropped == 20 and s.bytes == 0


def test_failure_lines_are_rate_limited_with_a_count_of_those_held_back(tmp_path, monkeypatch, caplog):
    disk = DiskRegistry(tmp_path, LAYOUT, budget_bytes=1 << 20)
    disk.put(entry(1))
    disk.log.interval = 0.05
    DiskFaults(monkeypatch, tmp_path).mode = "failing"
    with caplog.at_level(logging.WARNING, logger="irminsul.store"):
        for _ in range(30):
            disk.get(1, ids(0))
        time.sleep(0.06)
        disk.get(1, ids(0))
    lines = store_lines(caplog)
    assert len(lines) == 2 and "disk tier" in lines[0] and "EIO" in lines[0] or "Input/output" in lines[0], lines
    assert "29 more since the last report" in lines[1], lines


# -- planted entries: an entry that does not verify never blocks a legitimate write -------------


def forged(blob: bytes, **changes) -> bytes:
    """The blob with its metadata changed and its MAC left as it was (written without the secret)."""
    from safetensors.torch import load, save

    (n,) = struct.unpack("<Q", blob[:8])
    meta = {**json.loads(blob[8 : 8 + n])["__metadata__"], **changes}
    return save(load(blob), metadata=meta)


def test_a_planted_disk_file_is_replaced_by_the_legitimate_write(tmp_path):
    from irminsul.kvcache.store.codec import encode

    disk = DiskRegistry(tmp_path, LAYOUT, budget_bytes=1 << 20)
    for fp, blob in (
        (0x51, b"garbage"),
        (0x52, forged(encode(entry(0x52), LAYOUT), base_pos="7")),
        (0x53, forged(encode(entry(0x53), LAYOUT), key_id="0123456789abcdef")),
    ):
        disk._path(fp).write_bytes(blob)  # planted before start: the index picks it up by its name
    disk = DiskRegistry(tmp_path, LAYOUT, budget_bytes=1 << 20)
    assert len(disk) == 3
    for fp in (0x51, 0x52, 0x53):
        assert disk.put(entry(fp))  # before anyone read it
        got = disk.get(fp, ids(0))
        assert got is not None and torch.equal(got.payload, entry(fp).payload), hex(fp)
    assert disk.tier_stats.corrupt == 3


def test_a_planted_redis_value_is_replaced_and_a_racing_writer_is_not_clobbered(redis_proc):
    from irminsul.kvcache.store.codec import encode

    r = RedisRegistry(redis_proc.url, LAYOUT)
    client = redis_proc.client()
    planted = {
        0x61: b"garbage",
        0x62: forged(encode(entry(0x62), LAYOUT), fingerprint="00000000000000ff"),
        0x63: forged(encode(entry(0x63), LAYOUT), key_id="0123456789abcdef"),
    }
    for fp, blob in planted.items():
        client.set(r._key(fp), blob)
    for fp in planted:
        assert r.put(entry(fp))  # before anyone read it: SET NX finds the key taken
    assert r.flush()
    for fp in planted:
        got = r.get(fp, ids(0))
        assert got is not None and torch.equal(got.payload, entry(fp).payload), hex(fp)
    # A reader that saw a bad value deletes it only if the key still holds it: here a legitimate
    # writer replaced it between the reader's GET and its delete.
    good = encode(entry(0x64), LAYOUT)
    client.set(r._key(0x64), good)
    real_get = r.client.get
    r.client.get = lambda key: b"garbage"  # what the reader saw, a moment before the writer's SET
    assert r.get(0x64, ids(0)) is None and r.tier_stats.corrupt == 4
    r.client.get = real_get
    assert client.get(r._key(0x64)) == good
    r.close()


# -- Redis at maxmemory --------------------------------------------------------------------------


def test_redis_refusing_writes_at_maxmemory_still_serves_reads():
    """With maxmemory and the default noeviction policy, Redis refuses writes (OOM) but answers
    reads: a refused write is dropped and counted, and the breaker stays closed."""
    proc = RedisProcess(options=("--maxmemory", "2mb", "--maxmemory-policy", "noeviction"))
    try:
        r = RedisRegistry(proc.url, LAYOUT)
        for i in range(30):
            assert r.put(entry(i, n=64, seed=i))
        assert r.flush()
        blob_limit = proc.client().info("memory")["used_memory"]
        proc.client().config_set("maxmemory", blob_limit)  # full from here on
        for i in range(30, 130):
            r.put(entry(i, n=64, seed=i))
        assert r.flush()
        s = r.tier_stats
        assert s.failures > 0 and s.dropped > 0 and s.available, s
        reused = sum(r.get(i, ids(i, 64)) is not None for i in range(30))
        assert reused == 30 and r.available
        r.close()
    finally:
        proc.stop()


def test_a_redis_that_fails_every_command_is_a_miss(redis_proc, monkeypatch, caplog):
    import redis

    r = RedisRegistry(redis_proc.url, LAYOUT, backoff=(30.0, 30.0))
    r.put(entry(1)) and r.flush()

    def down(*args, **kwargs):
        raise redis.ConnectionError("connection reset by peer")

    with caplog.at_level(logging.WARNING, logger="irminsul.store"):
        monkeypatch.setattr(redis.Redis, "execute_command", down)
        for _ in range(50):
            assert r.get(1, ids(0)) is None and r.peek(1) is None and 1 not in r
            r.put(entry(2))
        r.flush(1.0)
    s = r.tier_stats
    assert not s.available and s.failures >= 1 and s.dropped >= 1
    assert len(store_lines(caplog)) <= 1
    r.close()


# -- the tiered wrapper --------------------------------------------------------------------------


def test_a_lower_tier_that_raises_costs_reuse_never_the_caller(tmp_path, caplog):
    disk = DiskRegistry(tmp_path, LAYOUT, budget_bytes=1 << 20)
    disk.put(entry(5, seed=5))
    tiered = TieredRegistry(MemoryRegistry(10**6), [Raising(), disk])
    with caplog.at_level(logging.WARNING, logger="irminsul.store"):
        for _ in range(20):
            assert tiered.prefetch([(7, ids(7), "")]) == 0
            got = tiered.get(5, ids(5))  # the broken tier above the disk is skipped
            tiered.memory.evict(10**9)
            assert got is not None
            assert tiered.put(entry(6, seed=6))
        assert tiered.flush()
        tiered.close()
    broken, below = tier_stats(tiered)[1:]
    assert below.hits == 20 and 6 in disk
    assert broken.failures >= 60 and not broken.available  # 20 lookups, prefetches and writes each
    assert len(store_lines(caplog)) <= 2


def test_a_promotion_into_a_slow_disk_does_not_wait_on_the_caller(tmp_path, redis_proc, monkeypatch):
    """A Redis hit is copied into the disk tier by the writer thread, not by the lookup."""
    reg = open_registry(StoreConfig(("memory", f"disk:{tmp_path}", redis_proc.url)), LAYOUT)
    redis = reg.lower[1]
    redis.put(entry(3, seed=3)) and redis.flush()
    disk = reg.lower[0]
    calls = []
    monkeypatch.setattr(disk, "put", lambda e: calls.append(threading_name()) or True)
    assert reg.get(3, ids(3)) is not None and reg.flush()
    assert calls == ["irminsul-store-writer"]
    reg.close()


def threading_name() -> str:
    import threading

    return threading.current_thread().name


# -- through the engine: every request completes with the tokens it gets with no store ------------

DOCS = [np.random.default_rng(s).integers(0, 250, 300).tolist() for s in range(3)]
FIRST = [np.random.default_rng(10 + i).integers(0, 250, 20).tolist() + d for i, d in enumerate(DOCS)]
NEW = [np.random.default_rng(20 + i).integers(0, 250, 200).tolist() for i in range(2)]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    from irminsul.engine.llm import LLM

    return LLM(tiny_dir, reuse="pic", compile_decode=False)


def generate(llm, registry, prompts):
    """The prompts through a fresh engine and scheduler over `registry` (a restart: memory is empty)."""
    from irminsul.engine.build import build_engine
    from irminsul.engine.config import EngineConfig

    config = EngineConfig.of(
        reuse="pic",
        kv_cache_gib=0.01,
        compile_decode=False,
        max_running_requests=16,
        decode_slowdown=None,
        model_id="faults",
    )
    llm.engine = build_engine(config, llm.model, llm.tokenizer, registry=registry)
    out = llm.generate(prompts, max_tokens=3, ignore_eos=True)  # raises if any request failed
    return [r.token_ids for r in out], [r.stats.reused_tokens for r in out]


@pytest.fixture(scope="module")
def reference(llm):
    first, _ = generate(llm, MemoryRegistry(int(0.01 * 2**30)), FIRST)
    again, _ = generate(llm, MemoryRegistry(int(0.01 * 2**30)), FIRST + NEW)
    return first, again


def store(llm, specs, raising=False) -> TieredRegistry:
    layout = RowLayout.of(llm.model, "faults")
    registry = open_registry(StoreConfig(("memory", *specs)), layout, memory_bytes=int(0.01 * 2**30))
    return TieredRegistry(registry.memory, [Raising(), *registry.lower]) if raising else registry


CASES = (
    [("disk", f) for f in (*DISK_FAULTS, "planted", "raising")]
    + [("redis", f) for f in ("failing", "full", "slow", "planted")]
    + [("disk+redis", f) for f in ("read-only", "planted")]
)


@pytest.mark.parametrize(("tiers", "fault"), CASES, ids=[f"{t}-{f}" for t, f in CASES])
def test_requests_complete_with_the_same_tokens_whatever_the_store_does(
    llm, reference, tmp_path, redis_proc, monkeypatch, caplog, tiers, fault
):
    import redis

    specs = ([f"disk:{tmp_path}"] if "disk" in tiers else []) + ([redis_proc.url] if "redis" in tiers else [])
    first = store(llm, specs)
    tokens, _ = generate(llm, first, FIRST)
    first.close()
    assert tokens == reference[0]
    client = redis_proc.client()
    second = store(llm, specs, raising=fault == "raising")  # a restart; the store fails after it
    disk_faults = DiskFaults(monkeypatch, tmp_path)
    if fault == "planted":
        for f in tmp_path.rglob("*.safetensors"):
            f.write_bytes(b"planted")
        for key in client.keys("irminsul:*"):
            client.set(key, b"planted")
    elif tiers == "redis":
        if fault == "failing":

            def down(*args, **kwargs):
                raise redis.ConnectionError("connection reset by peer")

            monkeypatch.setattr(redis.Redis, "execute_command", down)
        elif fault == "full":
            client.config_set("maxmemory", client.info("memory")["used_memory"])
        elif fault == "slow":
            real = redis.Redis.execute_command
            monkeypatch.setattr(
                redis.Redis, "execute_command", lambda self, *a, **k: time.sleep(0.002) or real(self, *a, **k)
            )
    elif fault != "raising":
        disk_faults.mode = fault
    with caplog.at_level(logging.WARNING, logger="irminsul.store"):
        tokens, reused = generate(llm, second, FIRST + NEW)
        second.flush()
        stats = {t.tier: t for t in tier_stats(second)}
        second.close()
    assert tokens == reference[1], (tiers, fault)
    lines = store_lines(caplog)
    assert len(lines) <= len(second.lower), lines
    assert not list(tmp_path.rglob("*.tmp"))
    if fault in ("slow", "raising") or (fault == "read-only" and tiers == "disk"):
        assert sum(reused[:3]) > 0, (fault, reused)  # still served from the store
    if fault == "planted":
        assert sum(t.corrupt for t in stats.values()) > 0, stats
    elif fault not in ("slow", "vanishing"):
        assert sum(t.failures for t in stats.values()) > 0, (fault, stats)
