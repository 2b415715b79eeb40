"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434) in its absorbed form.

The cache holds one row per token and layer, `[c_KV | k_r]`: the latent after `kv_a_layernorm`
(kv_lora_rank wide, no position in it) and the decoupled RoPE key (qk_rope_head_dim wide, rotated
at the token's absolute position). Nothing else position-dependent is stored anywhere.

Absorbed attention (DeepSeek-V3 `inference/model.py`, attn_impl="absorb"):
    q_lat  = q_nope · W_UK                      # [n, H, kv_lora_rank]
    score  = (q_lat · c_KV + q_pe · k_r) * scale
    o      = (softmax(score) · c_KV) · W_UV -> o_proj
with scale = qk_head_dim^-0.5 * mscale² (YaRN). For many queries at once (prefill) it is cheaper
to expand the cached latent into per-head keys and values (k_nope = c_KV·W_UK, v = c_KV·W_UV) and
run ordinary attention; the layer picks the cheaper form per sequence. Both read the same cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from irminsul.model.config import ModelConfig
from irminsul.model.layers import RMSNorm
from irminsul.model.rope import Rotary


class SequenceRows:
    """One sequence's latent cache: rows [n_layers, capacity, kv_lora_rank + rope_dim] + filled mask.

    Positions may be filled in any order (prefix copies, reused chunks, computed spans); attention
    at position p reads every filled row at a position <= p.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, capacity: int = 256):
        self.cfg = cfg
        capacity = max(1, min(capacity, cfg.max_position_embeddings))
        self.rows = torch.zeros(cfg.num_hidden_layers, capacity, cfg.row_width, dtype=dtype, device=device)
        self.filled = torch.zeros(capacity, dtype=torch.bool, device=device)

    @property
    def capacity(self) -> int:
        return self.rows.shape[1]

    @property
    def length(self) -> int:
        """One past the highest filled position (0 when empty)."""
        idx = self.filled.nonzero()
        return int(idx[-1]) + 1 if len(idx) else 0

    def ensure(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        new = min(max(capacity, 2 * self.capacity), self.cfg.max_position_embeddings)
        rows = self.rows.new_zeros(self.rows.shape[0], new, self.rows.shape[2])
        rows[:, : self.capacity] = self.rows
        filled = self.filled.new_zeros(new)
        filled[: self.capacity] = self.filled
        self.rows, self.filled = rows, filled

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Copy rows [n_layers, n, width] verbatim into positions [start, start+n)."""
        n = rows.shape[1]
        self.ensure(start + n)
        self.rows[:, start : start + n] = rows.to(self.rows.dtype)
        self.filled[start : start + n] = True

    def clone(self) -> "SequenceRows":
        other = object.__new__(SequenceRows)
        other.cfg, other.rows, other.filled = self.cfg, self.rows.clone(), self.filled.clone()
        return other


@dataclass
class ForwardBatch:
    """Flat tokens of several sequences; sequence i owns tokens [offsets[i], offsets[i+1])."""

    token_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, absolute positions
    seqs: list[SequenceRows]
    offsets: list[int]  # len(seqs) + 1

    _memo: dict = field(default_factory=dict, repr=False)

    def slices(self):
        for i, seq in enumerate(self.seqs):
            yield seq, slice(self.offsets[i], self.offsets[i + 1])

    def memo(self, key, compute):
        """What every layer of one forward pass needs alike (RoPE cos/sin, attention masks), once."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary):
        super().__init__()
        self.cfg, self.layer, self.rotary = cfg, layer, rotary
        h, bias = cfg.num_attention_heads, cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.row_width, bias=bias)
        # HF builds kv_a_layernorm with its default eps (1e-6), not rms_norm_eps.
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=bias)

    def latent(self, x: torch.Tensor, positions: torch.Tensor, cos_sin=None) -> torch.Tensor:
        """x [n, hidden] -> cache rows [n, kv_lora_rank + rope_dim] (c_KV normed, k_r rotated)."""
        c, k_r = self.kv_a_proj_with_mqa(x).split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), self.rotary.apply(k_r, positions, cos_sin)], dim=-1)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cfg = self.cfg
        n, h, r = x.shape[0], cfg.num_attention_heads, cfg.kv_lora_rank
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(n, h, cfg.qk_head_dim).split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        cos_sin = batch.memo("rope", lambda: self.rotary.cos_sin(batch.positions))
        q_pe = self.rotary.apply(q_pe, batch.positions, cos_sin)  # [n, H, rope]
        w = self.kv_b_proj.weight.view(h, cfg.qk_nope_head_dim + cfg.v_head_dim, r)
        w_uk, w_uv = w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]  # absorbed into q / out
        rows = self.latent(x, batch.positions, cos_sin)  # [n, r + rope]

        out = x.new_empty(n, h, cfg.v_head_dim)
        for i, (seq, sl) in enumerate(batch.slices()):
            pos = batch.positions[sl]
            seq.rows[self.layer, pos] = rows[sl].to(seq.rows.dtype)
            keys = seq.rows[self.layer, : int(pos.max()) + 1].to(x.dtype)  # [L, r + rope]
            visible = batch.memo(("visible", i), lambda: seq.filled[: keys.shape[0]][None, :] & (
                torch.arange(keys.shape[0], device=pos.device)[None, :] <= pos[:, None]
            ))  # [m, L]; the same in every layer
            if self._expand_is_cheaper(len(pos), keys.shape[0]):
                out[sl] = self._expanded(q_nope[sl], q_pe[sl], keys, visible)
            else:
                c_kv, k_r = keys[:, :r], keys[:, r:]
                q_lat = torch.einsum("mhd,hdr->mhr", q_nope[sl], w_uk)  # [m, H, r]
                scores = (q_lat @ c_kv.T + q_pe[sl] @ k_r.T).float() * cfg.softmax_scale  # [m, H, L]
                probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(dim=-1).to(x.dtype)
                out[sl] = torch.einsum("mhr,hvr->mhv", probs @ c_kv, w_uv)
        return self.o_proj(out.reshape(n, h * cfg.v_head_dim))

    def _expand_is_cheaper(self, m: int, length: int) -> bool:
        """Absorbed attention costs ~m·L·H·(2r + rope) multiply-adds; expanding the latent into
        per-head keys and values costs L·H·r·(nope + v) once, then m·L·H·(nope + rope + v). Prefill
        (large m) expands, decode (m = 1) absorbs -- the same split SGLang and vLLM make for MLA."""
        c = self.cfg
        absorbed = m * length * (2 * c.kv_lora_rank + c.qk_rope_head_dim)
        expanded = length * c.kv_lora_rank * (c.qk_nope_head_dim + c.v_head_dim) + m * length * (
            c.qk_head_dim + c.v_head_dim)
        return expanded < absorbed

    def _expanded(self, q_nope, q_pe, keys, visible) -> torch.Tensor:
        """Attention with keys/values expanded from the cached latent: [m, H, v]."""
        cfg = self.cfg
        length, h = keys.shape[0], cfg.num_attention_heads
        kv = self.kv_b_proj(keys[:, : cfg.kv_lora_rank]).view(length, h, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k_r = keys[:, None, cfg.kv_lora_rank :].expand(length, h, cfg.qk_rope_head_dim)
        k = torch.cat([k_nope, k_r], dim=-1).transpose(0, 1)  # [H, L, qk_head]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, m, qk_head]
        o = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), attn_mask=visible, scale=cfg.softmax_scale)
        return o.transpose(0, 1)
