import numpy as np

from irminsul.kvcache.chunker import gear
from irminsul.kvcache.windows import _BASE, WindowHit, WindowIndex


def _slow_hash(tokens, s, w):
    x = gear(tokens).tolist()
    return sum(x[s + j] * pow(_BASE, j, 1 << 64) for j in range(w)) % (1 << 64)


def test_rolling_hash_equals_direct_polynomial_at_every_offset():
    tokens = np.random.default_rng(0).integers(0, 2**32, 300)
    idx = WindowIndex(window=16)
    fast = idx.rolling_hashes(tokens)
    assert len(fast) == 300 - 16 + 1
    assert fast.tolist() == [_slow_hash(tokens, s, 16) for s in range(len(fast))]
    assert len(idx.rolling_hashes(tokens[:15])) == 0


def test_windows_are_found_at_any_offset_and_removed():
    rng = np.random.default_rng(1)
    entry = rng.integers(0, 50_000, 300)  # windows at entry offsets 0 and 128
    idx = WindowIndex()
    idx.add(42, entry)
    assert len(idx) == 2
    query = np.concatenate([rng.integers(0, 50_000, 77), entry[100:290], rng.integers(0, 50_000, 50)])
    hits = idx.candidates(query, 0, len(query))
    assert WindowHit(77 + 28, 42, 128) in hits  # entry offset 128 sits at query 77 + (128 - 100)
    assert all(
        np.array_equal(query[h.query_pos : h.query_pos + 128], entry[h.entry_offset : h.entry_offset + 128])
        for h in hits
    )
    assert idx.candidates(query, 110, len(query)) == []  # span excludes the window start
    assert idx.candidates(query, 0, 77 + 28 + 127) == []  # span cuts the window's end
    idx.add(43, entry[:128])
    assert WindowHit(0, 43, 0) in idx.candidates(entry, 0, 300)
    idx.remove(42)
    idx.remove(42)  # idempotent
    assert idx.candidates(query, 0, len(query)) == [] and len(idx) == 1


def test_remove_entry_that_repeats_a_window():
    w = WindowIndex(4)
    w.add(7, [1, 2, 3, 4, 1, 2, 3, 4])
    w.add(8, [1, 2, 3, 4])
    w.remove(7)
    assert [(h.fingerprint, h.entry_offset) for h in w.candidates([1, 2, 3, 4], 0, 4)] == [(8, 0)]
    w.remove(8)
    assert len(w) == 0
