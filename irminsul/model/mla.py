"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434) in its absorbed form.

The cache holds one row per token and layer, `[c_KV | k_r]`: the latent after `kv_a_layernorm`
(kv_lora_rank wide) and the decoupled RoPE key (qk_rope_head_dim wide), stored un-rotated and
encoded at its position when attention reads it (`attention/`). A cached row has no position
in it, so reuse at another position shares it as it is.

Absorbed attention (DeepSeek-V3 `inference/model.py`, attn_impl="absorb"):
    q_lat  = q_nope · W_UK                      # [n, H, kv_lora_rank]
    score  = (q_lat · c_KV + q_pe · k_r) * scale
    o      = (softmax(score) · c_KV) · W_UV -> o_proj
with scale = qk_head_dim^-0.5 * mscale² (YaRN). For many queries at once (prefill) it is cheaper
to expand the cached latent into per-head keys and values (k_nope = c_KV·W_UK, v = c_KV·W_UV) and
run ordinary attention; the backend picks the cheaper form per group of sequences. Both read the
same cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from irminsul.model.attention import EMPTY_SLOT, AttentionBackend, SeqAttention
from irminsul.model.config import ModelConfig
from irminsul.model.kernel_choice import KernelChoices
from irminsul.model.layers import (
    Linear,
    RMSNorm,
    dnn_weight,
    gemv_rows,
    pack_linears,
    packed,
    snapshot,
    widen_rows,
    widen_rows_of,
)
from irminsul.model.rope import Rotary, encode_half
from irminsul.model.settings import Settings


class SequenceRows:
    """One sequence's rows in a private pool, for code that runs the model on one sequence outside
    the engine (tests, evaluation probes). Position p lives in slot p + 1; slot 0 is "no row".

    Positions may be filled in any order (copies, computed spans); attention at position p reads
    every filled row at a position <= p.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, capacity: int = 256):
        self.cfg = cfg
        capacity = max(1, min(capacity, cfg.max_position_embeddings))
        self.pool = torch.zeros(cfg.num_hidden_layers, capacity + 1, cfg.row_width, dtype=dtype, device=device)
        self.filled = torch.zeros(capacity, dtype=torch.bool, device=device)

    @property
    def capacity(self) -> int:
        return self.filled.shape[0]

    @property
    def length(self) -> int:
        """One past the highest filled position (0 when empty)."""
        idx = self.filled.nonzero()
        return int(idx[-1]) + 1 if len(idx) else 0

    @property
    def raw(self) -> torch.Tensor:
        """The stored rows [n_layers, capacity, width]: c_KV and un-rotated k_r (cache layout)."""
        return self.pool[:, 1:]

    def rows(self, rotary: Rotary, n: int | None = None) -> torch.Tensor:
        """Rows [n_layers, n, width] as transformers caches them: k_r encoded at each position."""
        n = self.length if n is None else n
        raw, r, latent = self.raw[:, :n], self.cfg.kv_lora_rank, self.cfg.latent_width
        cos, sin = rotary.table(n, raw.device)
        parts = [raw[..., :r], rotary.encode_cached(raw[..., r:latent], cos[:n], sin[:n])]
        if self.cfg.index_head_dim:  # V3.2's indexer keys, half-split rotary part encoded too
            parts.append(rope_half(raw[..., latent:].transpose(0, 1), cos[:n], sin[:n]).transpose(0, 1))
        return torch.cat(parts, dim=-1)

    def ensure(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        new = min(max(capacity, 2 * self.capacity), self.cfg.max_position_embeddings)
        pool = self.pool.new_zeros(self.pool.shape[0], new + 1, self.pool.shape[2])
        pool[:, : self.pool.shape[1]] = self.pool
        filled = self.filled.new_zeros(new)
        filled[: self.capacity] = self.filled
        self.pool, self.filled = pool, filled

    def write(self, start: int, raw: torch.Tensor) -> None:
        """Copy stored rows [n_layers, n, width] (as `raw` holds them) into positions [start, start+n)."""
        n = raw.shape[1]
        self.ensure(start + n)
        self.pool[:, 1 + start : 1 + start + n] = raw.to(self.pool.dtype)
        self.filled[start : start + n] = True

    def clone(self) -> SequenceRows:
        other = object.__new__(SequenceRows)
        other.cfg, other.pool, other.filled = self.cfg, self.pool.clone(), self.filled.clone()
        return other

    def batch(self, backend: AttentionBackend, token_ids: torch.Tensor, positions: torch.Tensor) -> ForwardBatch:
        """A one-sequence forward batch computing token_ids at positions into these rows."""
        self.ensure(int(positions.max()) + 1)
        self.filled[positions] = True  # every layer writes these rows before it attends
        t = int(positions.max()) + 1
        slots = np.where(self.filled[:t].cpu().numpy(), np.arange(1, t + 1), EMPTY_SLOT)
        seq = SeqAttention(positions.cpu().numpy(), slots)
        return ForwardBatch(token_ids, positions, self.pool, positions + 1, backend.plan([seq], [0], positions.device))


@dataclass
class ForwardBatch:
    """One forward pass: flat tokens of several sequences, where their rows go, how they attend."""

    token_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, absolute positions
    pool: torch.Tensor  # [n_layers, n_slots, width]: every row the pass reads or writes
    write_slots: torch.Tensor  # [N] int64: the pool slot each computed row is written to
    plan: object  # the attention backend's `plan` for these tokens (its own type)

    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def groups(self):
        """The torch backend's plan: its padded groups (at most one decode and one prefill group)."""
        return self.plan

    def memo(self, key, compute):
        """What every layer of one forward pass needs alike (RoPE cos/sin of the queries), once."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def attend(
        self, attn: MLAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, index=None
    ) -> torch.Tensor:
        """Store the layer's computed rows [N, row_width] at write_slots and attend over the pool
        (the backend's `forward` with this batch's plan) -> [N, H, v]."""
        pool = self.pool[attn.layer]  # [n_slots, width]
        # NOTE: written before attending: a query attends to rows computed in this same pass.
        pool.index_copy_(0, self.write_slots, rows.to(pool.dtype))
        return attn.backend.forward(attn, q_nope, q_pe, pool, self.plan, index)


class MLAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, rotary: Rotary, backend: AttentionBackend, settings: Settings | None = None
    ):
        """settings: its model's (its norms run by them; `layers.snapshot`)."""
        super().__init__()
        settings = snapshot(settings)
        self.cfg, self.layer, self.rotary, self.backend = cfg, layer, rotary, backend
        h, bias = cfg.num_attention_heads, cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, settings)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.latent_width, bias=bias)
        self.indexer = Indexer(cfg) if cfg.index_n_heads else None
        # HF builds kv_a_layernorm with its default eps (1e-6), not rms_norm_eps.
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, settings)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=bias)
        # LongCat-Flash scales q and the normed c_KV (what is cached) by sqrt(hidden / LoRA rank)
        self.q_scale = (cfg.hidden_size / cfg.q_lora_rank) ** 0.5 if cfg.mla_lora_scale else None
        self.kv_scale = (cfg.hidden_size / cfg.kv_lora_rank) ** 0.5 if cfg.mla_lora_scale else None
        self.in_proj: tuple[torch.Tensor, torch.Tensor | None] | None = None  # after `pack`
        self.in_proj_dnn: tuple[torch.Tensor | None, ...] | None = None  # its `dnn_weight`
        self.in_proj_gemv_rows = 0  # its products of at most this many rows through gemv.product (`gemv_rows`)
        self.in_proj_widen_rows = 0  # its products of at least this many rows through `widened` (`widen_rows`)
        # (W_UK, W_UV) each in memory of its own, for bf16/fp16 after `pack` (`AttentionBackend.absorbed_weights`),
        # and the kv_b_proj weight they were copied from
        self.absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
        # from how many rows on the W_UK and W_UV products run in float32 (bf16, after `pack`)
        self.absorbed_widen: tuple[int, int] = (0, 0)
        self.absorbed_from: int | None = None

    def _q_in(self) -> nn.Linear:
        return self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj

    def pack(self, choices: KernelChoices | None = None) -> None:
        """The two products of the layer's input (q or q_a, and kv_a) as one (`pack_linears`); each
        product laid out, copied and routed as `choices` measured for its shape (`DeepseekModel.pack`'s;
        None: the fixed rule)."""
        self.in_proj = pack_linears(self._q_in(), self.kv_a_proj_with_mqa, choices=choices)
        self.in_proj_dnn = dnn_weight(self.in_proj[0].t(), choices=choices)
        self.in_proj_gemv_rows = gemv_rows(self.in_proj[0].t(), choices)
        self.in_proj_widen_rows = widen_rows(self.in_proj[0].t(), choices)
        for lin in (self.kv_b_proj, self.o_proj) + ((self.q_b_proj,) if self.cfg.q_lora_rank is not None else ()):
            lin.pack_dnn(choices)
        # NOTE: W_UK and W_UV are slices of kv_b_proj's weight, one head (nope + v) x r apart; a bf16
        # bmm copies such a batch to a contiguous one on every call (an order of magnitude slower than
        # the product itself at realistic shapes), so they are kept apart: one more copy of kv_b (a
        # fraction of a percent of a realistic model's weights). float32's bmm reads the slices in place.
        self.absorbed = self.absorbed_from = None
        w = self.kv_b_proj.weight
        if w.dtype in (torch.bfloat16, torch.float16):
            with torch.no_grad():  # (the backend's views of the two halves, while none are kept)
                w_uk, w_uv = (half.detach() for half in self.backend.absorbed_weights(self))
                # (W_UK stored [H, r, nope]: each output's weights contiguous, as the native per-head
                # products read them, attention.base._heads; bmm reads either)
                self.absorbed = (w_uk.transpose(1, 2).contiguous().transpose(1, 2), w_uv.contiguous())
                cfg = self.cfg  # (each head's product: [n, nope] x [nope, r], then [n, r] x [r, v])
                self.absorbed_widen = (
                    widen_rows_of(cfg.kv_lora_rank, cfg.qk_nope_head_dim, w.dtype, w.device, choices),
                    widen_rows_of(cfg.v_head_dim, cfg.kv_lora_rank, w.dtype, w.device, choices),
                )
            self.absorbed_from = w.data_ptr()

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (q_proj(x) or q_a_proj(x), kv_a_proj_with_mqa(x))."""
        q_in = self._q_in()
        # (a compiled graph cannot compare data pointers: the compiled step takes packed models only)
        if self.in_proj is None or (
            not torch.compiler.is_compiling() and self.in_proj[0].data_ptr() != q_in.weight.data_ptr()
        ):
            return q_in(x), self.kv_a_proj_with_mqa(x)
        return packed(x, *self.in_proj, self.in_proj_dnn, self.in_proj_gemv_rows, self.in_proj_widen_rows).split(
            [q_in.out_features, self.cfg.latent_width], dim=-1
        )

    def _c_kv(self, c: torch.Tensor) -> torch.Tensor:
        c = self.kv_a_layernorm(c)
        return c if self.kv_scale is None else c * self.kv_scale

    def stored_rows(self, x: torch.Tensor, kv: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, hidden] -> pool rows [n, row_width]: c_KV normed, k_r un-rotated (and V3.2's
        indexer key, its rotary part un-rotated). kv: kv_a_proj_with_mqa(x) when already computed."""
        kv = self.kv_a_proj_with_mqa(x) if kv is None else kv
        c, k_r = kv.split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        parts = [self._c_kv(c), self.rotary.to_cache(k_r)]
        if self.indexer is not None:
            parts.append(self.indexer.key(x))
        return torch.cat(parts, dim=-1)

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> rows [n, kv_lora_rank + rope_dim] as transformers caches them (k_r
        encoded at positions)."""
        c, k_r = self.kv_a_proj_with_mqa(x).split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        parts = [self._c_kv(c), self.rotary.apply(k_r, positions)]
        if self.indexer is not None:
            parts.append(rope_half(self.indexer.key(x), *self.rotary.cos_sin(positions)))
        return torch.cat(parts, dim=-1)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cfg = self.cfg
        n, h = x.shape[0], cfg.num_attention_heads
        q, kv = self._project(x)
        q_resid = None if cfg.q_lora_rank is None else self.q_a_layernorm(q)
        q = q if q_resid is None else self.q_b_proj(q_resid)
        if self.q_scale is not None:
            q = q * self.q_scale
        q_nope, q_pe = q.view(n, h, cfg.qk_head_dim).split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        cos_sin = batch.memo("rope", lambda: self.rotary.cos_sin(batch.positions))
        q_pe = self.rotary.apply(q_pe, batch.positions, cos_sin)  # [n, H, rope]
        index = None if self.indexer is None else self.indexer.queries(x, q_resid, cos_sin)
        out = batch.attend(self, q_nope, q_pe, self.stored_rows(x, kv), index)  # [n, H, v]
        return self.o_proj(out.reshape(n, h * cfg.v_head_dim))


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`encode_half` of x [n, ..., d] at n positions (cos/sin [n, half], broadcast over the middle dims)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    return encode_half(x, cos.reshape(shape), sin.reshape(shape))


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer (DSA): per query, scores every earlier key by
    sum_h w_h * relu(q_h . k) / sqrt(d) and keeps the index_topk best for the MLA attention. Its
    key, LayerNorm(wk x), is cached in the pool row beside [c_KV | k_r], its rotary part (the first
    qk_rope_head_dim dims, half-split) un-rotated and encoded at read, like k_r."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=1e-6)
        # kept in float32 whatever the model dtype (transformers' _keep_in_fp32_modules)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)

    def key(self, x: torch.Tensor) -> torch.Tensor:
        return self.k_norm(self.wk(x))

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [n, heads, d] rotated at the queries' positions and scaled by d^-1/2, weights [n, heads]
        float32 scaled by heads^-1/2)."""
        cfg = self.cfg
        q = self.wq_b(q_resid).view(x.shape[0], cfg.index_n_heads, cfg.index_head_dim)
        q = rope_half(q, *cos_sin).float() * cfg.index_head_dim**-0.5
        w = F.linear(x.float(), self.weights_proj.weight.float()) * cfg.index_n_heads**-0.5
        return q, w
