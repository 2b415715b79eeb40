"""V4's attention: one shared key/value head over a sliding window, plus compressed entries pooled over
windows (HCA; CSA with its lightning indexer), per-head sinks, the grouped output projection; and the
per-token rows that make a token's state reusable at another position (docs/deepseek-v4.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from irminsul.model.deepseek_v4.config import CSA, HCA, SLIDING, CosSin, Rotations, V4Config, rotate_tail

# ------------------------------------------------------------------------------------------------ norms


class RMSNorm(nn.Module):
    """RMSNorm whose weight stays float32 and multiplies before the cast back. (layers.RMSNorm casts first, as
    V2/V3 do; V4 keeps every norm in float32, transformers' `_keep_in_fp32_modules_strict`.)"""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x scaled to unit root-mean-square over its last dim (no weight): V4's per-head query norm, and the norm
    of the flattened streams that hyper-connections read."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# ------------------------------------------------------------------------------------------------ attention


def sliding_window_mask(q_pos: torch.Tensor, n_keys: int, window: int) -> torch.Tensor:
    """[n, n_keys] bool: the query at position t sees the keys at t - window + 1 .. t."""
    distance = q_pos[:, None] - torch.arange(n_keys, device=q_pos.device)[None, :]
    return (distance >= 0) & (distance < window)


def closed_windows(q_pos: torch.Tensor, n_entries: int, rate: int) -> torch.Tensor:
    """[n, n_entries] bool: entry w (tokens w*rate .. (w+1)*rate - 1) is complete at query t, (w+1)*rate <= t+1."""
    ready = (q_pos + 1) // rate
    return torch.arange(n_entries, device=q_pos.device)[None, :] < ready[:, None]


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, S, H, D] over one shared key/value head kv [B, K, D] where allowed [B, S, K]; each head's softmax
    also holds a learned sink logit that absorbs probability and adds nothing (gpt-oss style). -> [B, S, H, D]"""
    b, s, h, _ = q.shape
    logits = (torch.einsum("bshd,bkd->bhsk", q, kv) * scale).float()
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    with_sink = torch.cat([logits, sinks.float().view(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)
    probs = with_sink.softmax(dim=-1)[..., :-1].to(kv.dtype)
    return torch.einsum("bhsk,bkd->bshd", probs, kv)


class WindowPool(nn.Module):
    """Compressed entries: one per closed window of `rate` tokens, a softmax-gated sum of the window's projected
    tokens (gate logits + a learned bias per offset in the window), RMS-normed, rotated at the window's first
    position. With `overlap` (CSA and its indexer) every token projects two series of `head_dim` channels: Ca
    (first half) joins the NEXT window's entry and Cb (second half) its own, so an entry pools 2 * rate slots."""

    def __init__(self, hidden: int, head_dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        width = (2 if overlap else 1) * head_dim
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(head_dim, eps)

    @property
    def row_width(self) -> int:
        return 2 * self.kv_proj.out_features

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden] -> the per-token inputs of the pooling [B, S, 2 * width]: [kv_proj(x) | gate_proj(x)].
        They have no position in them: where a token sits enters only when windows are formed (`entries`)."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def entries(self, rows: torch.Tensor, rot: CosSin) -> torch.Tensor:
        """Per-token rows [B, T, 2 * width] of positions 0..T-1 -> entries [B, T // rate, head_dim]: windows at
        absolute multiples of `rate`, the bias by each token's offset in its window, each entry rotated at its
        window's first position. The tokens of a trailing partial window wait."""
        b, s, _ = rows.shape
        n, m, d = s // self.rate, self.rate, self.head_dim
        if n == 0:
            return rows.new_zeros(b, 0, d)
        kv, gate = rows[:, : n * m].unflatten(1, (n, m)).chunk(2, dim=-1)  # [B, n, m, width] each
        gate = gate + self.position_bias
        if self.overlap:
            # slots 0..m-1: the previous window's Ca (none before window 0: zero values, -inf gates);
            # slots m..2m-1: this window's Cb
            previous_kv = F.pad(kv[:, :-1, :, :d], (0, 0, 0, 0, 1, 0))
            previous_gate = F.pad(gate[:, :-1, :, :d], (0, 0, 0, 0, 1, 0), value=float("-inf"))
            kv = torch.cat([previous_kv, kv[..., d:]], dim=2)  # [B, n, 2m, d]
            gate = torch.cat([previous_gate, gate[..., d:]], dim=2)
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
        starts = torch.arange(n, device=rows.device) * m
        return rotate_tail(self.kv_norm(pooled), rot.cos[starts], rot.sin[starts])


class HCACompressor(WindowPool):
    """HCA: non-overlapping windows of `hca_rate` tokens; a query sees every closed window."""

    def __init__(self, cfg: V4Config):
        super().__init__(cfg.hidden_size, cfg.head_dim, cfg.hca_rate, overlap=False, eps=cfg.rms_norm_eps)

    def forward(
        self, rows: torch.Tensor, x: torch.Tensor, q_latent: torch.Tensor, q_pos: torch.Tensor, rot: CosSin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [B, T, row_width] of every position; x, q_latent [B, n, ...] of the queries at q_pos [n]
        -> entries [B, E, head_dim], visible [B, n, E]"""
        entries = self.entries(rows, rot)
        visible = closed_windows(q_pos, entries.shape[1], self.rate)
        return entries, visible.expand(x.shape[0], -1, -1)


class Indexer(WindowPool):
    """CSA's lightning indexer (§2.3.1, eqs. 13-17): its own smaller compressed keys over the same windows, and
    score(t, s) = sum_h w_{t,h} * ReLU(q_{t,h} . k_s); a query keeps the `index_topk` best closed windows."""

    def __init__(self, cfg: V4Config):
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.csa_rate, overlap=True, eps=cfg.rms_norm_eps)
        self.n_heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.scorer = nn.Module()  # transformers' `scorer.weights_proj` key, kept as a plain holder
        self.scorer.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)

    def forward(
        self, rows: torch.Tensor, x: torch.Tensor, q_latent: torch.Tensor, q_pos: torch.Tensor, rot: CosSin
    ) -> torch.Tensor:
        """-> chosen [B, n, E] bool: the top-k closed windows of each query."""
        b = x.shape[0]
        keys = self.entries(rows, rot)  # [B, E, index_head_dim]
        closed = closed_windows(q_pos, keys.shape[1], self.rate)  # [n, E]
        if keys.shape[1] == 0:
            return closed.expand(b, -1, -1)
        q = self.q_b_proj(q_latent).unflatten(-1, (self.n_heads, self.head_dim))  # [B, n, H, d]
        q = rotate_tail(q, rot.cos[q_pos, None], rot.sin[q_pos, None])
        # the scales in transformers' order: ReLU(q.k) / sqrt(d), head weights / sqrt(H)
        relu = F.relu(torch.einsum("bshd,bed->bshe", q.float(), keys.float())) * self.head_dim**-0.5
        weights = self.scorer.weights_proj(x).float() * self.n_heads**-0.5  # [B, S, H]
        scores = (relu * weights[..., None]).sum(dim=2).masked_fill(~closed, float("-inf"))  # [B, S, E]
        top = scores.topk(min(self.topk, keys.shape[1]), dim=-1).indices
        # rows with fewer than k closed windows pick some open ones too: `& closed` drops them
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True) & closed


class CSACompressor(WindowPool):
    """CSA: overlapping windows of 2 * `csa_rate` tokens at stride `csa_rate`; the indexer picks which a query sees."""

    def __init__(self, cfg: V4Config):
        super().__init__(cfg.hidden_size, cfg.head_dim, cfg.csa_rate, overlap=True, eps=cfg.rms_norm_eps)
        self.indexer = Indexer(cfg)

    @property
    def row_width(self) -> int:  # its own pooling inputs, then the indexer's
        return 2 * self.kv_proj.out_features + self.indexer.row_width

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([super().rows(x), self.indexer.rows(x)], dim=-1)

    def forward(
        self, rows: torch.Tensor, x: torch.Tensor, q_latent: torch.Tensor, q_pos: torch.Tensor, rot: CosSin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        own, index = rows.split([2 * self.kv_proj.out_features, self.indexer.row_width], dim=-1)
        return self.entries(own, rot), self.indexer(index, x, q_latent, q_pos, rot)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: each of `groups` slices [..., groups, d_in] through its own [d_out, d_in]
    block of `weight` [groups * d_out, d_in] (the grouped output projection, §2.3.1)."""

    def __init__(self, d_in: int, d_out: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * d_out, d_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...gi,goi->...go", x, self.weight.unflatten(0, (self.groups, -1)))


class V4Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer: int):
        super().__init__()
        kind = cfg.layer_types[layer]
        self.rope_name = "main" if kind == SLIDING else "compress"
        self.n_heads, self.head_dim, self.window = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
        self.scale = cfg.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        heads_width = cfg.num_attention_heads * cfg.head_dim
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads_width, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(heads_width // cfg.o_groups, cfg.o_lora_rank, cfg.o_groups)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_attention_heads))
        compressors = {CSA: CSACompressor, HCA: HCACompressor}
        self.compressor = compressors[kind](cfg) if kind in compressors else None

    @property
    def row_width(self) -> int:
        """What one token leaves for later queries (`rows`): its key = value, rope slice un-rotated, then its
        compressor's (and indexer's) pooling inputs."""
        return self.head_dim + (0 if self.compressor is None else self.compressor.row_width)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, n, hidden] -> per-token rows [B, n, row_width], none of it position-dependent: the key's rope
        slice is rotated when attention reads it, compressed entries are pooled from the rows when read."""
        kv = self.kv_norm(self.kv_proj(x))
        return kv if self.compressor is None else torch.cat([kv, self.compressor.rows(x)], dim=-1)

    def forward(self, x: torch.Tensor, rotations: Rotations) -> torch.Tensor:
        """x [B, S, hidden] at positions 0..S-1 -> [B, S, hidden]"""
        return self.attend(x, self.rows(x), torch.arange(x.shape[1], device=x.device), None, rotations)

    def attend(
        self,
        x: torch.Tensor,
        rows: torch.Tensor,
        q_pos: torch.Tensor,
        key_pos: torch.Tensor | None,
        rotations: Rotations,
    ) -> torch.Tensor:
        """The queries x [B, n, hidden] at positions q_pos [n] over the rows [B, T, row_width] of positions
        0..T-1 (theirs included) -> [B, n, hidden]. Each key is rotated at key_pos [T] (default: its own
        position; the stale positions it was computed at for the `naive` baseline); compressed entries are
        pooled from the rows at their absolute windows."""
        b, n, _ = x.shape
        t = rows.shape[1]
        cos, sin = getattr(rotations, self.rope_name)
        q_latent = self.q_a_norm(self.q_a_proj(x))  # [B, n, q_lora_rank], the indexer reads it too
        q = unit_rms(self.q_b_proj(q_latent).unflatten(-1, (self.n_heads, self.head_dim)), self.eps)
        q = rotate_tail(q, cos[q_pos, None], sin[q_pos, None])  # [B, n, H, D]
        kp = torch.arange(t, device=x.device) if key_pos is None else key_pos
        kv = rotate_tail(rows[..., : self.head_dim], cos[kp], sin[kp])  # [B, T, D]: the one key = value head
        allowed = sliding_window_mask(q_pos, t, self.window).expand(b, -1, -1)
        if self.compressor is not None:
            entries, visible = self.compressor(rows[..., self.head_dim :], x, q_latent, q_pos, rotations.compress)
            kv = torch.cat([kv, entries], dim=1)  # [B, T + E, D]
            allowed = torch.cat([allowed, visible], dim=-1)
        out = sink_attention(q, kv, allowed, self.sinks, self.scale)
        # V = K carried each key's rotation into the output; the conjugate at the query's position leaves
        # only relative angles in the rope slice
        out = rotate_tail(out, cos[q_pos, None], -sin[q_pos, None])
        return self.o_b_proj(self.o_a_proj(out.reshape(b, n, self.o_a_proj.groups, -1)).flatten(2))
