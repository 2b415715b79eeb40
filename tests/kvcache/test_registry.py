import numpy as np
import pytest

from irminsul.kvcache.registry import Entry, MemoryRegistry


def _entry(fp, n=4, nbytes=10, tokens=None):
    ids = np.arange(fp, fp + n) if tokens is None else np.asarray(tokens)
    return Entry(fp, ids, base_pos=100, payload=None, nbytes=nbytes)


def test_verified_hit_miss_and_collision():
    reg = MemoryRegistry(100)
    e = _entry(1)
    assert reg.put(e)
    assert reg.get(1, np.arange(1, 5)) is e
    assert reg.get(1, np.arange(1, 5, dtype=np.int32)) is e  # dtype does not matter, values do
    assert reg.get(1, np.array([1, 2, 3, 9])) is None  # same fingerprint, other tokens
    assert reg.get(1, np.arange(1, 4)) is None  # same fingerprint, other length
    assert reg.get(2, np.arange(2, 6)) is None
    s = reg.stats
    assert (s.hits, s.misses, s.collisions, s.entries, s.bytes) == (2, 3, 2, 1, 10)
    assert reg.peek(1) is e and reg.peek(2) is None
    assert reg.stats == s  # peek counts nothing


def test_lru_order_and_peek_does_not_touch():
    reg = MemoryRegistry(30)
    for fp in (1, 2, 3):
        reg.put(_entry(fp))
    reg.get(1, np.arange(1, 5))  # 1 becomes most recent
    reg.peek(2)  # 2 stays least recent
    evicted = []
    reg.on_evict.append(lambda e: evicted.append(e.fingerprint))
    reg.put(_entry(4))
    assert evicted == [2] and 2 not in reg and len(reg) == 3
    reg.put(_entry(5, nbytes=20))
    assert evicted == [2, 3, 1] and list(map(lambda fp: fp in reg, (4, 5))) == [True, True]
    assert reg.stats.evictions == 3


def test_replacement_keeps_budget_and_notifies():
    reg = MemoryRegistry(30)
    removed = []
    reg.on_evict.append(lambda e: removed.append(e))
    old = _entry(1, nbytes=20)
    reg.put(old)
    reg.put(_entry(2))
    new = _entry(1, tokens=[9, 9], nbytes=25)  # replacing frees the old 20 first, then evicts 2
    assert reg.put(new)
    assert removed[0] is old and reg.peek(1) is new and 2 not in reg
    assert reg.stats.bytes == 25 and reg.stats.evictions == 1


def test_pinned_entries_are_never_evicted():
    reg = MemoryRegistry(30)
    for fp in (1, 2, 3):
        reg.put(_entry(fp))
    reg.pin(1)
    reg.pin(1)
    reg.pin(2)
    assert reg.stats.pinned == 2
    assert reg.put(_entry(4))  # evicts 3, the only unpinned one
    assert 3 not in reg and 1 in reg and 2 in reg
    before = reg.stats
    assert not reg.put(_entry(5, nbytes=15))  # cannot fit without evicting a pinned entry
    assert 4 in reg and reg.stats.rejected == before.rejected + 1  # a rejected put evicts nothing
    reg.unpin(1)
    assert reg.stats.pinned == 2  # still pinned once
    reg.unpin(1)
    reg.unpin(2)
    assert reg.put(_entry(5, nbytes=30)) and len(reg) == 1
    with pytest.raises(KeyError, match="not pinned"):
        reg.unpin(5)
    with pytest.raises(KeyError, match="not in the registry"):
        reg.pin(99)


def test_oversized_entry_is_rejected():
    reg = MemoryRegistry(10)
    assert not reg.put(_entry(1, nbytes=11))
    assert reg.put(_entry(2, nbytes=10)) and reg.stats.rejected == 1


def test_budget_never_exceeded_under_random_ops():
    rng = np.random.default_rng(0)
    reg = MemoryRegistry(1000)
    pins: list[int] = []
    for _ in range(3000):
        op, fp = rng.integers(0, 10), int(rng.integers(0, 60))
        if op < 5:
            reg.put(_entry(fp, nbytes=int(rng.integers(1, 500))))
        elif op < 7:
            reg.get(fp, np.arange(fp, fp + 4))
        elif op < 8 and len(reg):
            live = [f for f in range(60) if f in reg]
            pins.append(live[int(rng.integers(0, len(live)))])
            reg.pin(pins[-1])
        elif op < 9 and pins and rng.random() < 0.5:
            reg.unpin(pins.pop(int(rng.integers(0, len(pins)))))
        s = reg.stats
        assert s.bytes <= s.budget_bytes
        assert s.bytes == sum(reg.peek(f).nbytes for f in range(60) if f in reg)
        assert all(f in reg for f in pins)  # a pinned entry is never evicted
    assert reg.stats.evictions > 0 and reg.stats.rejected > 0
