"""pic+r: which reused rows a sequence recomputes in its own context (CacheBlend, Yao et al. 2025).

The fraction r of the reused rows whose latent c_KV at the check layer deviates most from what the
current context gives. Layers [0, check_layer) run over every non-prefix position into scratch
slots (the model runs through the `latents` callable the engine gives); only their latent at the
check layer is compared with the cached row's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from irminsul.kvcache.admission import CachedSequence
from irminsul.kvcache.manager import KVCacheManager

# latents(tokens, run, table, write, layer): layers [0, layer) over positions `run` of `tokens`, their
# rows written to slots `write`, attending to the rows `table` names; c_KV [len(run), rank] at `layer`
Latents = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int], torch.Tensor]


class Recompute:
    def __init__(self, kv: KVCacheManager, latents: Latents, rank: int):
        """`rank`: the latent's width (kv_lora_rank): the rows' first `rank` columns are compared."""
        self.kv, self.latents, self.rank = kv, latents, rank
        self.ratio, self.check_layer = kv.recompute_ratio, kv.check_layer

    def choose(self, seq: CachedSequence) -> np.ndarray | None:
        """The positions (increasing) of the reused rows seq recomputes; None if the pool has no room
        for the scratch rows now."""
        kv, pool = self.kv, self.kv.pool
        assert seq.reuse_plan is not None, "the scheduler asks only for a sequence admitted with a plan"
        reused = np.concatenate(
            [np.arange(s.start, s.end) for s in seq.reuse_plan.spans if s.kind == "reuse"] or [np.zeros(0, np.int64)]
        )
        k = int(math.ceil(self.ratio * len(reused)))
        if k == 0:
            return reused[:0]
        run = np.union1d(reused, seq.pending)
        scratch = kv.take(len(run))
        if scratch is None:
            return None
        try:
            table = seq.slots.copy()
            table[run] = scratch
            pool.mark_computed(scratch, run)
            fresh = self.latents(np.asarray(seq.tokens), run, table, scratch, self.check_layer)
            dev = pool.rows.device
            at = torch.as_tensor(np.searchsorted(run, reused), device=dev)
            cached = pool.rows[self.check_layer, torch.as_tensor(seq.slots[reused], device=dev), : self.rank].float()
            deviation = (fresh[at].float() - cached).norm(dim=-1) / cached.norm(dim=-1).clamp_min(1e-12)
            return np.sort(reused[deviation.topk(k).indices.cpu().numpy()])
        finally:
            pool.release(scratch)
