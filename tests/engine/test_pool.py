"""The latent pool's slot allocator."""

import numpy as np
import torch

from irminsul.kvcache.pool import LatentPool
from irminsul.model.config import ModelConfig
from irminsul.model.tiny import tiny_config


def test_slots_come_out_in_increasing_runs_even_after_frees():
    """Freed slots go back lowest on top, so a request admitted after others finished still gets
    consecutive increasing slots: attention then reads its rows in place (AttentionGroup.run)."""
    pool = LatentPool(ModelConfig.from_dict(tiny_config("v2")), 64, torch.float32)
    first = pool.alloc(10)
    assert (np.diff(first) == 1).all()
    second = pool.alloc(5)
    pool.release(first)
    pool.release(second)
    again = pool.alloc(12)
    assert (np.diff(again) == 1).all() and again[0] == 1
    assert pool.free == 63 - 12
    shared = again[:4]
    pool.retain(shared)  # a second holder: released once, the slots stay
    pool.release(again)
    assert pool.free == 63 - 4 and (pool.refs[shared] == 1).all()


def test_random_alloc_retain_release_keeps_the_books():
    """Any interleaving of allocations, extra references and releases: a slot is free exactly when no one
    holds it, never handed out twice, and every allocation comes out in increasing order."""
    rng = np.random.default_rng(0)
    pool = LatentPool(ModelConfig.from_dict(tiny_config("v2")), 200, torch.float32)
    held: list[np.ndarray] = []
    for _ in range(2000):
        op = rng.integers(0, 3)
        if op == 0:
            got = pool.alloc(int(rng.integers(1, 30)))
            if got is not None:
                assert (np.diff(got) > 0).all()
                assert not set(got.tolist()) & {s for h in held for s in h.tolist()}
                held.append(got)
        elif op == 1 and held:
            some = held[int(rng.integers(len(held)))]
            pool.retain(some)
            held.append(some.copy())
        elif held:
            pool.release(held.pop(int(rng.integers(len(held)))))
        counts = np.zeros(200, np.int64)
        for h in held:
            np.add.at(counts, h, 1)
        counts[0] = 1
        assert (pool.refs == counts).all()
        free = pool._free[: pool._top]
        assert len(set(free.tolist())) == len(free) == int((counts == 0).sum())
        assert (pool.refs[free] == 0).all()
