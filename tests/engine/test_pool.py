"""The latent pool's slot allocator."""

import numpy as np
import torch

from irminsul.engine.pool import LatentPool
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
