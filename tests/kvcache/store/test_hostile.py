"""Store fault injection: whoever can write the disk store's directory, or answer on Redis's address,
costs at most a miss, never a stall, unbounded memory or an exception to the caller.

Disk: a FIFO, a symbolic link (to /dev/zero, or to a valid copy of the entry), a sparse file larger
than any entry, and a directory, each where an entry should be. Redis: a server that answers every
GET with a bulk header and then one byte every 0.1 s (never silent long enough for a per-read
timeout, even on a loaded machine), one that answers the handshake (HELLO) with +OK, and one that
answers the size gauge's commands with +OK. Every call runs on a thread joined with a timeout, so a
regression fails instead of hanging the suite.
"""

import logging
import os
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch

from irminsul.kvcache.registry import Entry
from irminsul.kvcache.store import StoreConfig, open_registry, tier_stats
from irminsul.kvcache.store.disk import DiskRegistry
from irminsul.kvcache.store.redis import RedisRegistry
from tests.kvcache.store.conftest import LAYOUT

HOSTILE = ("fifo", "link-to-dev-zero", "link-to-an-entry", "sparse", "directory")
SPARSE_BYTES = 2**30  # far beyond the largest entry: truncate makes it without using the disk
PEAK_BYTES = 16 * 2**20  # what a lookup may allocate: a few entries' worth, far below the hostile files


def entry(fp, n=8, seed=0):
    rows = torch.randn(2, n, 6, generator=torch.Generator().manual_seed(seed))
    return Entry(fp, np.arange(seed, seed + n, dtype=np.int64), 0, rows, rows.numel() * 4)


def ids(seed, n=8):
    return np.arange(seed, seed + n, dtype=np.int64)


def promptly(fn, *args, timeout: float = 5.0):
    """fn(*args) on a daemon thread: its result, or a failure (not a hang) if it takes over `timeout`."""
    result, error = [], []

    def run():
        try:
            result.append(fn(*args))
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {timeout} s"
    if error:
        raise error[0]
    return result[0]


def wait_until(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)
    return True


def plant(path, kind: str, copy) -> None:
    """Put a hostile `kind` of file at `path`; `copy` is a valid entry for the same fingerprint elsewhere."""
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "link-to-an-entry":
        path.symlink_to(copy)
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(SPARSE_BYTES)
    elif kind == "directory":
        path.mkdir()


def store_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "irminsul.store"]


# -- the disk tier -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_file_in_place_of_an_entry_is_a_prompt_miss(tmp_path, caplog, kind):
    elsewhere = DiskRegistry(tmp_path / "elsewhere", LAYOUT, budget_bytes=1 << 20)
    assert elsewhere.put(entry(1))  # a valid copy of entry 1, outside the store
    disk = DiskRegistry(tmp_path / "store", LAYOUT, budget_bytes=1 << 20)
    assert disk.put(entry(1)) and disk.put(entry(2, seed=2))
    plant(disk._path(1), kind, elsewhere._path(1))
    with caplog.at_level(logging.WARNING, logger="irminsul.store"):
        tracemalloc.start()
        try:
            got = promptly(disk.get, 1, ids(0))
            peeked = promptly(disk.peek, 1)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert got is None and peeked is None, kind
        assert peak < PEAK_BYTES, f"{kind}: a lookup allocated {peak} bytes"
        hit = promptly(disk.get, 2, ids(2))  # the rest of the store still serves
        assert hit is not None and torch.equal(hit.payload, entry(2, seed=2).payload)
    s = disk.tier_stats
    assert 1 not in disk and s.corrupt == 1 and s.entries == 1, (kind, s)
    lines = store_lines(caplog)
    assert len(lines) == 1 and f"{1:016x}" in lines[0].getMessage() and not lines[0].exc_info, lines
    assert os.path.isfile(elsewhere._path(1))  # a link's target is never touched
    if kind != "directory":  # (a directory is left where it is, out of the index)
        assert not os.path.lexists(disk._path(1))
        assert promptly(disk.put, entry(1))  # the legitimate write takes the place back
        assert promptly(disk.get, 1, ids(0)) is not None


def test_an_intact_entry_hits_while_a_fifo_sits_in_the_store(tmp_path):
    disk = DiskRegistry(tmp_path, LAYOUT, budget_bytes=1 << 20)
    for fp in (1, 2):
        assert disk.put(entry(fp, seed=fp))
    plant(disk._path(1), "fifo", None)
    stuck = threading.Thread(target=disk.get, args=(1, ids(1)), daemon=True)
    stuck.start()  # a lookup of the FIFO, racing the lookup below
    hit = promptly(disk.get, 2, ids(2))
    assert hit is not None and torch.equal(hit.payload, entry(2, seed=2).payload)
    stuck.join(5.0)
    assert not stuck.is_alive(), "the lookup of the FIFO blocked"


def test_a_slow_read_holds_no_lock(tmp_path, monkeypatch):
    """A read that takes its time (a slow disk, or a file that blocks) delays that lookup only."""
    import pathlib

    disk = DiskRegistry(tmp_path, LAYOUT, budget_bytes=1 << 20)
    for fp in (1, 2):
        assert disk.put(entry(fp, seed=fp))
    slow, entered, release = str(disk._path(1)), threading.Event(), threading.Event()
    real_open, real_read_bytes = os.open, pathlib.Path.read_bytes

    def opened(path, *args, **kwargs):
        if str(path) == slow:
            entered.set()
            release.wait(10)
        return real_open(path, *args, **kwargs)

    def read_bytes(path):
        if str(path) == slow:
            entered.set()
            release.wait(10)
        return real_read_bytes(path)

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
    waiting = threading.Thread(target=disk.get, args=(1, ids(1)), daemon=True)
    waiting.start()
    assert entered.wait(5.0)  # the lookup of entry 1 is inside its read now
    try:
        assert promptly(disk.get, 2, ids(2), timeout=3.0) is not None
        assert promptly(disk.put, entry(3, seed=3), timeout=3.0)
    finally:
        release.set()
    waiting.join(5.0)


def test_hostile_files_found_at_start_are_not_entries(tmp_path, caplog):
    """The index scan at start takes regular files of an entry's size only: a planted sparse file
    must not count against the budget (evicting real entries), a FIFO or a link is no entry."""
    elsewhere = DiskRegistry(tmp_path / "elsewhere", LAYOUT, budget_bytes=1 << 20)
    disk = DiskRegistry(tmp_path / "store", LAYOUT, budget_bytes=1 << 20)
    kept = (1, 2, 3, 0xCAFE)
    for fp in kept:
        assert disk.put(entry(fp, seed=fp))
    (disk.dir / "cafe").mkdir()  # an operator's folder whose name reads as hex: no entry's name, left alone
    for i, kind in enumerate(HOSTILE):
        fp = 100 + i
        assert elsewhere.put(entry(fp))
        plant(disk._path(fp), kind, elsewhere._path(fp))
    with caplog.at_level(logging.WARNING, logger="irminsul.store"):
        again = promptly(DiskRegistry, tmp_path / "store", LAYOUT, 1 << 20)
        assert [fp for fp in kept if fp in again] == list(kept)
        for i, kind in enumerate(HOSTILE):
            assert 100 + i not in again, kind
            assert promptly(again.get, 100 + i, ids(0)) is None, kind
        assert promptly(again.get, 2, ids(2)) is not None
    s = again.tier_stats
    assert s.entries == len(kept) and s.bytes == sum(os.path.getsize(again._path(fp)) for fp in kept), s
    assert [os.path.lexists(again._path(100 + i)) for i in range(len(HOSTILE))] == [False] * 4 + [True]
    assert (again.dir / "cafe").is_dir()
    lines = store_lines(caplog)
    assert len(lines) == 1 and not lines[0].exc_info, lines


def test_the_disk_tier_never_writes_what_it_would_refuse_to_read(tmp_path):
    disk = DiskRegistry(tmp_path, LAYOUT, budget_bytes=1 << 30)
    assert not disk.put(entry(1, n=2 * LAYOUT.max_tokens)) and 1 not in disk and disk.stats.rejected == 1
    assert disk.put(entry(2, n=LAYOUT.max_tokens))
    assert os.path.getsize(disk._path(2)) <= LAYOUT.max_blob_bytes
    assert disk.get(2, ids(0, LAYOUT.max_tokens)) is not None


# -- the Redis tier ------------------------------------------------------------------------------


class FakeRedis:
    """A TCP server on 127.0.0.1 that reads RESP commands and answers each with `reply(name)`: the
    bytes to send, or an iterable of byte strings sent one at a time with `pause` between them."""

    def __init__(self, reply, pause: float = 0.0):
        self.reply, self.pause = reply, pause
        self.commands: list[str] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.server.getsockname()[1]}/0"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        with conn, conn.makefile("rb") as f:
            try:
                while not self._closed:
                    header = f.readline()
                    if not header.startswith(b"*"):
                        return
                    args = []
                    for _ in range(int(header[1:])):
                        n = int(f.readline()[1:])
                        args.append(f.read(n + 2)[:-2])
                    name = args[0].decode().upper()
                    self.commands.append(name)
                    answer = self.reply(name)
                    if isinstance(answer, bytes):
                        conn.sendall(answer)
                        continue
                    for piece in answer:
                        conn.sendall(piece)
                        time.sleep(self.pause)
            except (OSError, ValueError):
                return

    def close(self) -> None:
        self._closed = True
        self.server.close()


HELLO_RESP3 = b"%1\r\n$5\r\nproto\r\n:3\r\n"


def dripping(name: str):
    """A Redis that answers at once, an empty one, except every GET: a 1,000-byte value, a byte at a time."""
    if name == "GET":
        return [b"$1000\r\n", *(b"x" for _ in range(1000)), b"\r\n"]
    return {"HELLO": HELLO_RESP3, "PING": b"+PONG\r\n", "DBSIZE": b":0\r\n", "SCAN": b"*2\r\n$1\r\n0\r\n*0\r\n"}.get(
        name, b"+OK\r\n"
    )


@pytest.fixture
def drip():
    server = FakeRedis(dripping, pause=0.1)
    yield server
    server.close()


def test_a_redis_that_drips_is_cut_off_at_the_deadline_and_opens_the_breaker(drip):
    r = RedisRegistry(drip.url, LAYOUT)
    assert r.available  # PING answers at once
    t = time.monotonic()
    assert promptly(r.get, 1, ids(0)) is None
    took = time.monotonic() - t
    assert not r.available and r.tier_stats.failures == 1, r.tier_stats
    assert took < r.timeout_s + 1.0, took  # (one deadline for the command, whatever the server sends)
    before = drip.commands.count("GET")
    assert promptly(r.get, 1, ids(0)) is None and drip.commands.count("GET") == before  # the breaker is open
    r.close()


def test_the_caller_of_a_tiered_store_sees_a_miss_from_a_dripping_redis(drip):
    registry = open_registry(StoreConfig(("memory", drip.url)), LAYOUT)
    assert promptly(registry.get, 1, ids(0)) is None
    assert promptly(registry.prefetch, [(2, ids(0), "")]) == 0
    redis = {t.tier: t for t in tier_stats(registry)}["redis"]
    assert redis.failures >= 1 and not redis.available
    registry.close()


def test_a_redis_that_fails_again_soon_after_it_came_back_is_retried_later_each_time(drip):
    """PING answers, every GET drips: each recovery is followed by a failure, so the breaker waits
    twice as long each time instead of letting every new request pay the deadline."""
    r = RedisRegistry(drip.url, LAYOUT, backoff=(0.05, 5.0))
    waits = []
    for _ in range(3):
        promptly(lambda: wait_until(lambda: r.available, 5.0))
        t = time.monotonic()
        assert promptly(r.get, 1, ids(0)) is None and not r.available
        waits.append(r._retry_at - t)
    assert waits[0] < waits[1] < waits[2], waits
    r.close()


def test_replies_of_the_wrong_shape_never_stop_the_background_thread():
    """The size gauge's DBSIZE and SCAN answered with +OK: a failure, and the thread that writes and
    probes lives on."""
    server = FakeRedis(lambda name: {"HELLO": HELLO_RESP3, "PING": b"+PONG\r\n"}.get(name, b"+OK\r\n"))
    try:
        r = RedisRegistry(server.url, LAYOUT)
        promptly(r._refresh_size)
        assert not r.available and r.tier_stats.failures >= 1 and r._thread.is_alive()
        r.close()
    finally:
        server.close()


def test_a_peer_that_answers_hello_wrongly_is_a_tier_marked_down_with_one_clear_line(caplog):
    wrong = FakeRedis(lambda name: b"+OK\r\n")
    try:
        with caplog.at_level(logging.WARNING, logger="irminsul.store"):
            registry = promptly(open_registry, StoreConfig(("memory", wrong.url)), LAYOUT)
            redis = registry.lower[0]
            assert not redis.available
            assert promptly(registry.get, 1, ids(0)) is None
            assert registry.put(entry(1)) and registry.flush()
        lines = store_lines(caplog)
        assert len(lines) == 1 and not lines[0].exc_info, lines
        message = lines[0].getMessage()
        assert wrong.url in message and "handshake" in message and "\n" not in message, message
        registry.close()
    finally:
        wrong.close()
