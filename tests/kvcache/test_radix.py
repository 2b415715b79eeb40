import numpy as np
import pytest

from irminsul.kvcache.radix import RadixCache


def _concat(match):
    return np.concatenate([v for v, _ in match.values]) if match.values else np.zeros(0, np.int64)


def _lcp(a, b):
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def test_match_and_insert_against_brute_force():
    rng = np.random.default_rng(0)
    tree = RadixCache(budget_bytes=10**9, bytes_per_token=1)
    stored = []
    for _ in range(300):
        if stored and rng.random() < 0.7:  # share a prefix with a stored sequence, then diverge
            base = stored[rng.integers(len(stored))]
            seq = np.concatenate([base[: rng.integers(0, len(base) + 1)], rng.integers(0, 4, rng.integers(0, 12))])
        else:
            seq = rng.integers(0, 4, rng.integers(1, 20))
        m = tree.match(seq)
        assert m.length == max((_lcp(seq, s) for s in stored), default=0)
        assert np.array_equal(_concat(m), seq[: m.length])  # values are in order and split right
        assert sum(n for _, n in m.values) == m.length
        tree.insert(seq, seq.copy())  # the value covers all tokens; the tree keeps the new suffix
        stored.append(seq)
    assert tree.stats.bytes == sum(len(n.key) for n in tree._iter_nodes())


def test_engine_style_split_of_rows():
    # rows [n_layers, len, width]: the engine splits along axis 1
    tree = RadixCache(10**9, 1, split_value=lambda v, k: (v[:, :k], v[:, k:]))
    rows = lambda seq: np.stack([np.asarray(seq) * 10 + layer for layer in range(2)])[..., None]  # noqa: E731
    tree.insert([1, 2, 3, 4], rows([1, 2, 3, 4]))
    tree.insert([1, 2, 9], rows([1, 2, 9]))
    m = tree.match([1, 2, 9, 7])
    assert m.length == 3
    assert np.array_equal(np.concatenate([v for v, _ in m.values], axis=1), rows([1, 2, 9]))
    assert [n for _, n in tree.match([1, 2, 3]).values] == [2, 1]  # match split 3|4


def test_lru_eviction_order_and_locks():
    tree = RadixCache(budget_bytes=100, bytes_per_token=2)
    tree.insert([1, 1, 1, 1], list("aaaa"))
    tree.insert([2, 2, 2, 2], list("bbbb"))
    tree.insert([3, 3, 3, 3], list("cccc"))
    tree.match([1, 1])  # splits [1] into 1,1|1,1; only the upper half is touched
    assert tree.evict(1) == 4  # the untouched lower half is the least recent leaf
    assert tree.match([1, 1, 1, 1]).length == 2
    assert tree.evict(1) == 8  # now [2] is the least recent
    assert tree.match([2, 2]).length == 0 and tree.stats.evictions == 2
    locked = tree.match([3, 3, 3, 3])
    tree.lock(locked.node)
    tree.evict(10**6)  # everything unlocked goes, leaves first then their parents
    assert tree.match([3, 3, 3, 3]).length == 4 and tree.match([1]).length == 0
    assert tree.stats.bytes == 8
    tree.unlock(locked.node)
    with pytest.raises(ValueError, match="unlock"):
        tree.unlock(locked.node)
    tree.evict(8)
    assert tree.stats.bytes == 0 and tree.stats.nodes == 0


def test_budget_evicts_first_then_truncates():
    tree = RadixCache(budget_bytes=10, bytes_per_token=1)
    assert tree.insert(list(range(6)), list(range(6))) == 6
    # extending the cached path: the path is protected, so only 4 more tokens fit
    assert tree.insert(list(range(12)), list(range(12))) == 4
    m = tree.match(list(range(12)))
    assert m.length == 10 and m.values[0].value + m.values[1].value == list(range(10))
    # a new branch evicts the LRU leaf (the 4-token tail); the rest of the old path stays
    assert tree.insert([50, 51, 52], [50, 51, 52]) == 3
    assert tree.stats.bytes == 9 and tree.stats.tokens_rejected == 2
    assert tree.match(list(range(12))).length == 6
    # nothing unlocked to evict: the insert stores what fits, here nothing
    tree.lock(tree.match(list(range(6))).node)
    tree.lock(tree.match([50, 51, 52]).node)
    assert tree.insert([60, 61], [60, 61]) == 1
    tree.lock(tree.match([60]).node)
    assert tree.insert([70], [70]) == 0 and tree.stats.bytes == 10


def test_budget_never_exceeded_and_locked_paths_survive():
    rng = np.random.default_rng(1)
    tree = RadixCache(budget_bytes=300, bytes_per_token=3)
    held = []
    for _ in range(400):
        seq = rng.integers(0, 3, rng.integers(1, 40))
        tree.insert(seq, seq)
        m = tree.match(seq[: rng.integers(1, len(seq) + 1)])
        if m.length and rng.random() < 0.2:
            tree.lock(m.node)
            held.append((seq[: m.length], m.node))
        if held and rng.random() < 0.2:
            tree.unlock(held.pop(0)[1])
        assert tree.stats.bytes <= 300
        for prefix, _ in held:
            assert tree.match(prefix).length == len(prefix)
    assert tree.stats.evictions > 0


def test_model_free_values_may_be_none():
    tree = RadixCache(10**9, 1)
    tree.insert([1, 2, 3], None)
    tree.insert([1, 2, 4], None)
    m = tree.match([1, 2, 3])
    assert m.length == 3 and [v for v, _ in m.values] == [None, None]


def test_cut_forgets_a_named_row_its_tail_and_everything_below():
    """`cut` drops, in each node, the first row it names and all after it (and every node below):
    each cached sequence then matches exactly up to its first dropped row, no stored value names a
    dropped row, and what the tree reports evicted is what it stopped holding."""
    rng = np.random.default_rng(3)
    for trial in range(20):
        held = []
        tree = RadixCache(10**9, 1, on_store=lambda v: held.append(len(v)), on_evict=lambda v: held.append(-len(v)))
        stored, next_row = [], 1
        for _ in range(40):
            if stored and rng.random() < 0.6:
                base = stored[rng.integers(len(stored))]
                seq = np.concatenate([base[: rng.integers(0, len(base) + 1)], rng.integers(0, 5, rng.integers(1, 10))])
            else:
                seq = rng.integers(0, 5, rng.integers(1, 15))
            rows = np.arange(next_row, next_row + len(seq))  # each position its own row id
            next_row += len(seq)
            tree.insert(seq, rows)
            stored.append(seq)
        before = [_concat(tree.match(s)) for s in stored]  # the rows each sequence reads
        gone = np.zeros(next_row, bool)
        gone[rng.choice(np.arange(1, next_row), size=int(rng.integers(1, 12)), replace=False)] = True

        def first_gone(value):
            hit = np.flatnonzero(gone[value])
            return int(hit[0]) if len(hit) else None

        tree.cut(first_gone)
        for seq, rows in zip(stored, before):
            hit = np.flatnonzero(gone[rows])
            assert tree.match(seq).length == (int(hit[0]) if len(hit) else len(rows)), trial
        assert not any(gone[n.value].any() for n in tree._iter_nodes())
        assert sum(held) == tree.stats.bytes == sum(len(n.key) for n in tree._iter_nodes())
        assert tree.stats.nodes == sum(1 for _ in tree._iter_nodes())
