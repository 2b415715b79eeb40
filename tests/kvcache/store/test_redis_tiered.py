"""Redis tier against a real redis-server, and the memory -> disk -> Redis tiering."""

import numpy as np
import pytest
import torch

from irminsul.kvcache.registry import MemoryRegistry
from irminsul.kvcache.store import StoreConfig, open_registry, tier_stats
from irminsul.kvcache.store.redis import RedisRegistry
from irminsul.kvcache.store.tiered import TieredRegistry
from tests.support.services import wait_for


def entry(fp, n=8, seed=0):
    rows = torch.randn(2, n, 6, generator=torch.Generator().manual_seed(seed))
    from irminsul.kvcache.registry import Entry

    return Entry(fp, np.arange(seed, seed + n, dtype=np.int64), 0, rows, rows.numel() * 4)


def test_two_clients_share_entries_and_reads_are_verified(redis_proc, layout):
    a, b = RedisRegistry(redis_proc.url, layout), RedisRegistry(redis_proc.url, layout)
    assert a.put(entry(7, seed=3)) and a.flush()
    got = b.get(7, np.arange(3, 11))
    assert got is not None and torch.equal(got.payload, entry(7, seed=3).payload)
    assert b.get(7, np.arange(4, 12)) is None and b.stats.collisions == 1
    assert not redis_proc.client().exists(b._key(7))  # a mismatching entry is dropped
    redis_proc.client().set(b._key(8), b"garbage")
    assert b.get(8, np.arange(0, 8)) is None and b.tier_stats.corrupt == 1
    assert not redis_proc.client().exists(b._key(8))
    a.close(), b.close()


def test_redis_outage_is_survived_and_reconnects(redis_proc, layout):
    r = RedisRegistry(redis_proc.url, layout, backoff=(0.05, 0.2))
    r.put(entry(1)) and r.flush()
    redis_proc.stop()
    assert r.get(1, np.arange(0, 8)) is None  # fails fast, counts, opens the breaker
    s = r.tier_stats
    assert s.failures >= 1 and not s.available
    assert not r.put(entry(2)) and r.tier_stats.dropped >= 1  # dropped, never blocks
    redis_proc.start()  # an empty Redis on the same port
    wait_for(lambda: r.available, 10, "the Redis tier to reconnect")
    assert r.put(entry(3, seed=5)) and r.flush()
    assert r.get(3, np.arange(5, 13)) is not None
    r.close()


def test_redis_down_at_start_does_not_block(layout):
    from tests.support.services import free_port

    r = RedisRegistry(f"redis://127.0.0.1:{free_port()}/0", layout)
    assert not r.available and r.get(1, np.arange(8)) is None and not r.put(entry(1))
    r.close()


def test_tiered_falls_through_promotes_and_pins(tmp_path, redis_proc, layout):
    cfg = StoreConfig(("memory", f"disk:{tmp_path}", redis_proc.url), memory_bytes=10_000)
    reg = open_registry(cfg, layout)
    assert isinstance(reg, TieredRegistry) and [t.tier for t in tier_stats(reg)] == ["memory", "disk", "redis"]
    evicted = []
    reg.on_evict.append(lambda e: evicted.append(e.fingerprint))
    for fp in range(1, 6):  # 384 B per entry in memory: all fit; all reach disk and redis
        assert reg.put(entry(fp, seed=fp))
    assert reg.flush() and reg.lower[1].flush()  # the writer thread, then Redis's own queue
    # A second replica with an empty memory tier and its own disk sees Redis only.
    other = open_registry(StoreConfig(("memory", f"disk:{tmp_path / 'b'}", redis_proc.url)), layout)
    got = other.get(3, np.arange(3, 11))
    assert got is not None and 3 in other.memory  # promoted to memory now, and to disk by the writer
    assert other.flush() and 3 in other.lower[0]
    other.pin(3)
    other.unpin(3)
    other.pin(99), other.unpin(99)  # not in memory: a counted no-op
    stats = {t.tier: t for t in tier_stats(other)}
    assert stats["redis"].hits == 1 and stats["memory"].misses == 1 and other.stats.hits == 1
    # memory budget holds; evictions reach the window-index callback
    small = TieredRegistry(MemoryRegistry(800), [reg.lower[0]])
    small.on_evict.append(lambda e: evicted.append(e.fingerprint))
    for fp in range(10, 14):
        small.put(entry(fp))
    assert small.memory.stats.bytes <= 800 and evicted
    reg.close(), other.close()


def test_prefetch_stages_lower_tier_entries_so_the_lookup_does_no_io(tmp_path, layout):
    from irminsul.kvcache.store.disk import DiskRegistry

    disk = DiskRegistry(tmp_path, layout, 10**7)
    disk.put(entry(11, seed=1))
    tiered = TieredRegistry(MemoryRegistry(10**6), [disk])
    assert tiered.prefetch([(11, np.arange(1, 9), ""), (12, np.arange(0, 8), "")]) == 1  # 12 is nowhere

    def no_io(*args):
        raise AssertionError("the disk was read at lookup time")

    disk.get = no_io
    got = tiered.get(11, np.arange(1, 9))  # staged: promoted without touching the disk
    assert got is not None and torch.equal(got.payload, entry(11, seed=1).payload) and 11 in tiered.memory


def test_the_size_gauge_does_bounded_work_whatever_redis_holds(redis_proc, layout):
    """The size gauge's refresh is one bounded SCAN call plus DBSIZE, never a walk over every key:
    it runs every 2 s, and O(keys) work there would load a shared Redis forever."""
    client = redis_proc.client()
    client.mset({f"other:{i}": b"x" * 10 for i in range(3000)})  # another application's keys
    r = RedisRegistry(redis_proc.url, layout)
    for i in range(5):
        r.put(entry(50 + i, seed=i))
    assert r.flush()
    calls = []
    scan = r.client.scan
    r.client.scan = lambda *a, **k: calls.append(k) or scan(*a, **k)
    r.client.scan_iter = lambda *a, **k: pytest.fail("scan_iter walks every key")
    r._refresh_size()
    assert len(calls) == 1 and calls[0]["count"] <= 64
    assert r.tier_stats.entries == 3005 and r.tier_stats.bytes > 0  # DBSIZE: the whole db
    r.close()


def test_redis_entries_can_expire(redis_proc, layout, tmp_path):
    registry = open_registry(StoreConfig(("memory", redis_proc.url), redis_ttl_s=120), layout)
    registry.put(entry(77))
    redis = registry.lower[0]
    assert registry.flush() and redis.flush()
    assert 0 < redis_proc.client().ttl(redis._key(77)) <= 120
    registry.close()


def test_lower_tier_writes_never_wait_on_the_caller(tmp_path, layout):
    """Writes to the lower tiers (disk) run off the caller's thread: put returns at once, so a slow
    disk never stalls the thread that decodes, and with it every stream."""
    import threading

    from irminsul.kvcache.store.disk import DiskRegistry

    disk = DiskRegistry(tmp_path, layout, 10**7)
    release = threading.Event()
    put = disk.put
    disk.put = lambda e: release.wait(10) and put(e)  # a disk that takes its time
    tiered = TieredRegistry(MemoryRegistry(10**6), [disk])
    import time

    t = time.perf_counter()
    assert tiered.put(entry(5))
    assert time.perf_counter() - t < 1.0 and 5 in tiered.memory and 5 not in disk
    release.set()
    assert tiered.flush() and 5 in disk
