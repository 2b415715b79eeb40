"""Executes the cache's plans on a sequence's latent rows (design doc, sections 3 and 4).

  off     every prompt token is computed (the quality reference);
  prefix  exact-prefix rows from the radix tree, copied as they are;
  naive   prefix + content-addressed chunks, c_KV and k_r copied verbatim (stale k_r: the
          paper's baseline), no sink carve-out;
  pic     prefix + content-addressed chunks with the sink carve-out; c_KV copied verbatim and
          k_r rotated by δ = p_tgt - p_src with the model's own rotary class.

The planner is pure bookkeeping; this module is where rows move.
"""

from __future__ import annotations

import numpy as np
import torch

from irminsul.engine.sequence import Sequence
from irminsul.errors import RequestError
from irminsul.model.deepseek import DeepseekModel

MODES = ("off", "prefix", "naive", "pic")
DEFAULT_CACHE_BYTES = 512 * 2**20


def make_reuse(mode: str, model: DeepseekModel, **options):
    if mode not in MODES:
        raise RequestError(f"reuse={mode!r} is not a reuse mode; choose one of {', '.join(MODES)}")
    if mode == "off":
        return NoReuse()  # cache options are accepted and ignored: nothing is cached
    return CacheReuse(mode, model, **options)


class NoReuse:
    mode = "off"

    def prepare(self, seq: Sequence) -> None:
        n = len(seq.tokens)
        seq.pending = np.arange(n, dtype=np.int64)
        seq.stats.prompt_tokens = seq.stats.computed_tokens = n

    def finish(self, seq: Sequence) -> None:
        pass


class CacheReuse:
    def __init__(self, mode: str, model: DeepseekModel, cache_bytes: int | None = None,
                 prefix_bytes: int | None = None, tenant: str = "", model_id: str = "",
                 carve_out: bool | None = None, s1: bool = True, registry=None):
        from irminsul.cache.chunker import ChunkerConfig, namespace_seed
        from irminsul.cache.planner import Planner, PlannerConfig
        from irminsul.cache.radix import RadixCache
        from irminsul.cache.registry import MemoryRegistry
        from irminsul.cache.windows import WindowIndex

        self.mode, self.model = mode, model
        cfg = model.config
        self.bytes_per_token = cfg.num_hidden_layers * cfg.row_width * torch.finfo(model.dtype).bits // 8
        self.registry = registry or MemoryRegistry(cache_bytes or DEFAULT_CACHE_BYTES)
        self.windows = WindowIndex()  # the planner keeps it in step with registry evictions
        self.radix = RadixCache(prefix_bytes or DEFAULT_CACHE_BYTES, self.bytes_per_token,
                                split_value=lambda v, k: (v[:, :k].clone(), v[:, k:].clone()))
        if carve_out is None:
            carve_out = mode == "pic"  # the paper's naive baseline has no carve-out
        self.planner_config = PlannerConfig(chunker=ChunkerConfig(), content_reuse=mode != "prefix",
                                            s1=s1, carve_out=carve_out)
        self.planner = Planner(self.planner_config, self.registry, self.radix, self.windows,
                               seed=namespace_seed(model_id, tenant))

    def prepare(self, seq: Sequence) -> None:
        plan = self.planner.plan(np.asarray(seq.tokens, dtype=np.int64), seq.segment_starts)
        seq.plan = plan
        rows, r = seq.rows, self.model.config.kv_lora_rank
        for span in plan.spans:
            if span.kind == "prefix":
                rows.write(span.start, self._prefix_rows(plan, span.start, span.end))
            elif span.kind == "reuse":
                src = span.entry.payload[:, span.src_offset : span.src_offset + span.end - span.start]
                if self.mode != "naive" and span.delta:
                    src = src.clone()
                    # [n_layers, n, rope]: only k_r moves; c_KV is position-free and copied verbatim.
                    src[..., r:] = self.model.rotary.rotate(src[..., r:].transpose(0, 1), span.delta).transpose(0, 1)
                rows.write(span.start, src)
        seq.pending = np.asarray(plan.compute_positions(), dtype=np.int64)
        st = plan.stats
        seq.stats.prompt_tokens, seq.stats.prefix_tokens = st.prompt_tokens, st.prefix_tokens
        seq.stats.reused_tokens, seq.stats.computed_tokens = st.reused_tokens, st.computed_tokens
        seq.stats.carve_out_tokens, seq.stats.s1_tokens = st.carve_out_tokens, st.s1_tokens

    @staticmethod
    def _prefix_rows(plan, start: int, end: int) -> torch.Tensor:
        parts, have = [], 0
        for value, length in plan.prefix.values:
            parts.append(value[:, :length])
            have += length
            if have >= end:
                break
        return torch.cat(parts, dim=1)[:, start:end]

    def finish(self, seq: Sequence) -> None:
        """Register every chunk of the sequence (prompt and output) and insert it into the tree."""
        try:
            n = seq.rows.length
            if n and seq.finish_reason != "abort":
                tokens = np.asarray(seq.tokens[:n], dtype=np.int64)
                block = seq.rows.rows[:, :n]
                self.planner.register(tokens, rows_of=lambda a, b: block[:, a:b].clone(),
                                      nbytes_of=lambda k: k * self.bytes_per_token,
                                      segment_starts=seq.segment_starts)
                self.radix.insert(tokens, block.clone())
        finally:
            if seq.plan is not None:
                self.planner.release(seq.plan)
                seq.plan = None
