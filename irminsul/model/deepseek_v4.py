"""DeepSeek-V4: prefill of whole sequences, following transformers' `models/deepseek_v4/modeling_deepseek_v4.py`
(5.24) and the V4 paper's section numbers quoted there.

V4 keeps the KV cache small without MLA's latent: every layer attends with ONE shared key/value head (K = V,
multi-query) over
  * a sliding window of the last `sliding_window` tokens (every layer), plus
  * CSA layers ("compressed sparse attention", rate m = 4, §2.3.1): one compressed entry per m tokens, each
    pooled from an overlapping window of 2m tokens (two series, Ca from the previous window and Cb from its own),
    of which a lightning indexer keeps the `index_topk` best per query; or
  * HCA layers ("heavily compressed attention", rate m' = 128, §2.3.2): one entry per m' tokens from
    non-overlapping windows, all of them visible.
A compressed entry is a softmax-gated sum over its window (gate logits plus a learned per-offset bias),
RMS-normed, and rotated at the window's first position. Only the trailing `rope_dim` channels of a head carry
RoPE (interleaved pairs); V = K carries that rotation too, so the attention output's rope slice is rotated back
by the query's angle. Each head has a learned sink logit. Heads leave through a grouped low-rank projection
(o_a_proj per group of heads, then o_b_proj). Sliding-only layers use the "main" rotary; compressed layers use
the "compress" rotary (its own theta, YaRN as configured) for queries, keys and entries alike.

The residual is `hc_mult` parallel streams (manifold-constrained hyper-connections, §2.2): before each attention
or MoE block a learned map collapses them into the block's input; after it the output is spread back over the
streams while the streams are mixed by a Sinkhorn-normalised (doubly-stochastic) matrix. A final head collapses
them before the norm. MoE layers pick experts by a fixed token-id -> experts table ("hash_moe", §2.1) or by
top-k router scores ("moe"), add one shared expert, and clip the SwiGLU pre-activations at `swiglu_limit`.

Module and parameter names are transformers' in-memory ones (`model.layers.N.self_attn.compressor.indexer...`,
fused `mlp.experts.gate_up_proj`), so its `state_dict()` loads as it is; `load_deepseek_v4` also reads the
DeepSeek names that `save_pretrained` and the released checkpoints use on disk (`layers.N.attn.wq_a.weight`).
There is no incremental cache here: every forward starts at position 0. Attention builds the full
[heads, S, S + entries] score matrix, which is a reference, not a serving path.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from irminsul.errors import CheckpointError, ConfigError
from irminsul.model.config import RopeConfig
from irminsul.model.loader import resolve_dtype, weight_files
from irminsul.model.rope import encode_pairwise, inv_freq

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE, TOPK_MOE = "hash_moe", "moe"
_RATIO_TO_LAYER = {0: SLIDING, 4: CSA, 128: HCA}  # the per-layer ratios of DeepSeek's own config.json


# ------------------------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    compress_attention_factor: float  # multiplies the compress rotary's cos/sin; 1.0 in V4's released configs
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576

    def __post_init__(self):
        n = self.num_hidden_layers
        for name, kinds, allowed in (("layer_types", self.layer_types, (SLIDING, CSA, HCA)),
                                     ("mlp_layer_types", self.mlp_layer_types, (HASH_MOE, TOPK_MOE))):
            if len(kinds) != n or any(k not in allowed for k in kinds):
                raise ConfigError(f"{name}={list(kinds)}: need {n} entries, each one of {allowed}")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ConfigError(f"scoring_func={self.scoring_func!r} is not supported (sqrtsoftplus, sigmoid, softmax)")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError(f"o_groups={self.o_groups} must divide num_attention_heads * head_dim")
        for rope in (self.main_rope, self.compress_rope):
            if rope.dim > min(self.head_dim, self.index_head_dim):
                raise ConfigError(f"the rotary dim {rope.dim} exceeds head_dim or index_head_dim")

    def compress_rate(self, layer: int) -> int:
        return {CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_types[layer]]

    @classmethod
    def from_dict(cls, raw: dict) -> "V4Config":
        """config.json as transformers' `DeepseekV4Config` reads it, legacy keys included."""
        if raw.get("model_type") != "deepseek_v4":
            raise ConfigError(f"model_type={raw.get('model_type')!r}: this loader reads deepseek_v4 checkpoints")
        if raw.get("num_key_value_heads", 1) != 1:
            raise ConfigError("num_key_value_heads must be 1: V4 attends with one shared key/value head")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={raw['hidden_act']!r} is not supported (silu)")
        n = raw.get("num_hidden_layers", 43)
        rates = {CSA: 4, HCA: 128, **(raw.get("compress_rates") or {})}
        rates[CSA] = raw.get("compress_rate_csa", rates[CSA])
        rates[HCA] = raw.get("compress_rate_hca", rates[HCA])
        layer_types = raw.get("layer_types")
        if layer_types is None and raw.get("compress_ratios") is not None:
            unknown = set(raw["compress_ratios"]) - set(_RATIO_TO_LAYER)
            if unknown:
                raise ConfigError(f"compress_ratios holds {sorted(unknown)}; V4 knows {sorted(_RATIO_TO_LAYER)}")
            layer_types = [_RATIO_TO_LAYER[r] for r in raw["compress_ratios"]]
        if layer_types is None:  # transformers' default (V4-Pro): two HCA layers, then CSA / HCA alternating
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = raw.get("num_hash_layers", 3)
            mlp_types = [HASH_MOE] * min(n, n_hash) + [TOPK_MOE] * max(0, n - n_hash)
        head_dim = raw.get("head_dim", 512)
        main, compress = _rope_parameters(raw, head_dim)
        max_positions = raw.get("max_position_embeddings", 1048576)
        main_rope, _ = _rope(main, head_dim, max_positions)  # plain RoPE in every released config
        compress_rope, compress_factor = _rope(compress, head_dim, max_positions)
        return cls(
            vocab_size=raw.get("vocab_size", 129280), hidden_size=raw.get("hidden_size", 4096), num_hidden_layers=n,
            num_attention_heads=raw.get("num_attention_heads", 64), head_dim=head_dim,
            q_lora_rank=raw.get("q_lora_rank", 1024), o_groups=raw.get("o_groups", 8),
            o_lora_rank=raw.get("o_lora_rank", 1024), sliding_window=raw.get("sliding_window", 128),
            layer_types=tuple(layer_types[:n]), csa_rate=rates[CSA], hca_rate=rates[HCA],
            index_n_heads=raw.get("index_n_heads", 64), index_head_dim=raw.get("index_head_dim", 128),
            index_topk=raw.get("index_topk", 512), hc_mult=raw.get("hc_mult", 4),
            hc_sinkhorn_iters=raw.get("hc_sinkhorn_iters", 20), hc_eps=raw.get("hc_eps", 1e-6),
            mlp_layer_types=tuple(mlp_types[:n]), n_routed_experts=raw.get("n_routed_experts", 256),
            num_experts_per_tok=raw.get("num_experts_per_tok", 6),
            moe_intermediate_size=raw.get("moe_intermediate_size", 2048),
            scoring_func=raw.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=raw.get("routed_scaling_factor", 1.5), swiglu_limit=raw.get("swiglu_limit", 10.0),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), main_rope=main_rope, compress_rope=compress_rope,
            compress_attention_factor=compress_factor, tie_word_embeddings=raw.get("tie_word_embeddings", False),
            max_position_embeddings=max_positions,
        )


def _rope_parameters(raw: dict, head_dim: int) -> tuple[dict, dict]:
    """The "main" and "compress" rotary parameters. Saved configs nest them; older ones give one flat dict (the
    YaRN scaling, meant for the compress rotary only) plus `rope_theta` / `compress_rope_theta`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return params["main"], params["compress"]
    partial = raw.get("partial_rotary_factor") or raw.get("qk_rope_head_dim", 64) / head_dim
    main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0), "partial_rotary_factor": partial}
    compress = {**params, "rope_theta": raw.get("compress_rope_theta", 160000.0), "partial_rotary_factor": partial}
    compress["rope_type"] = compress.get("rope_type", compress.get("type", "default"))
    if compress["rope_type"] == "yarn":
        # DeepSeek's reference does not scale cos/sin by YaRN's mscale; transformers pins the factor to 1.0
        compress.setdefault("attention_factor", 1.0)
    return main, compress


def _rope(params: dict, head_dim: int, max_positions: int) -> tuple[RopeConfig, float]:
    """One rotary's frequencies (as `RopeConfig`) and the factor on its cos/sin, as transformers reads them."""
    kind = params.get("rope_type", params.get("type", "default"))
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if kind != "yarn":
        return RopeConfig(dim=dim, theta=params["rope_theta"], kind=kind), 1.0
    original = params["original_max_position_embeddings"]
    rope = RopeConfig(
        dim=dim, theta=params["rope_theta"], kind="yarn", factor=params.get("factor") or max_positions / original,
        original_max_position=original, beta_fast=params.get("beta_fast") or 32, beta_slow=params.get("beta_slow") or 1,
        mscale=params.get("mscale") or 0.0, mscale_all_dim=params.get("mscale_all_dim") or 0.0,
        # NOTE: transformers reads `truncate` from the outer {"main", "compress"} dict, so for V4 it is always True
        truncate=True,
    )
    factor = params.get("attention_factor")
    return rope, float(rope.attention_factor if factor is None else factor)


# ------------------------------------------------------------------------------------------------ rotary


class CosSin(NamedTuple):
    cos: torch.Tensor  # [S, rope_dim / 2] float32, one angle per interleaved pair
    sin: torch.Tensor


def rotary_table(rope: RopeConfig, attention_factor: float, n: int, device) -> CosSin:
    """cos/sin for positions 0..n-1. Angles are float32 products position * inv_freq, exactly as transformers
    forms them: irminsul.model.rope.Rotary's float64 angles would be more accurate at large positions, but
    log-prob parity needs the same rounding."""
    angles = torch.arange(n, device=device).float()[:, None] * inv_freq(rope).to(device)
    return CosSin(angles.cos() * attention_factor, angles.sin() * attention_factor)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the trailing `2 * cos.shape[-1]` channels of x [..., dim] (interleaved pairs), in float32;
    cos/sin [..., rope_dim / 2] broadcast against x's leading dims. V4 lays a head out as [nope | rope]."""
    r = 2 * cos.shape[-1]
    return torch.cat([x[..., :-r], encode_pairwise(x[..., -r:], cos, sin, "interleaved")], dim=-1)


class Rotations(NamedTuple):
    main: CosSin  # sliding-only layers
    compress: CosSin  # CSA / HCA layers, their compressed entries and the indexer


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


def sink_attention(q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
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

    def forward(self, rows: torch.Tensor, x: torch.Tensor, q_latent: torch.Tensor, q_pos: torch.Tensor,
                rot: CosSin) -> tuple[torch.Tensor, torch.Tensor]:
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

    def forward(self, rows: torch.Tensor, x: torch.Tensor, q_latent: torch.Tensor, q_pos: torch.Tensor,
                rot: CosSin) -> torch.Tensor:
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

    def forward(self, rows: torch.Tensor, x: torch.Tensor, q_latent: torch.Tensor, q_pos: torch.Tensor,
                rot: CosSin) -> tuple[torch.Tensor, torch.Tensor]:
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

    def attend(self, x: torch.Tensor, rows: torch.Tensor, q_pos: torch.Tensor, key_pos: torch.Tensor | None,
               rotations: Rotations) -> torch.Tensor:
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


# ------------------------------------------------------------------------------------------------ hyper-connections


class StreamMix(NamedTuple):
    block_input: torch.Tensor  # [B, S, hidden]: the streams collapsed for the block
    post: torch.Tensor  # [B, S, n] float32: how the block's output spreads over the streams
    comb: torch.Tensor  # [B, S, n, n] float32, doubly stochastic: how the streams mix


def sinkhorn(m: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp on the last two dims of positive m: columns, then (rows, columns) iters - 1 more times."""
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection around one block: a one-layer map of the flattened, RMS-normed
    streams gives pre (collapse), post (spread) and comb (mix) weights."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        n = self.n = cfg.hc_mult
        self.iters, self.hc_eps, self.norm_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))  # one each for pre, post, comb

    def forward(self, streams: torch.Tensor) -> StreamMix:
        n = self.n
        mix = F.linear(unit_rms(streams.flatten(2).float(), self.norm_eps), self.fn.float())  # [B, S, (2+n)n]
        pre, post, comb = mix.split([n, n, n * n], dim=-1)
        pre_base, post_base, comb_base = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre * pre_scale + pre_base) + self.hc_eps
        post = 2 * torch.sigmoid(post * post_scale + post_base)
        comb = torch.softmax(comb.unflatten(-1, (n, n)) * comb_scale + comb_base.view(n, n), dim=-1) + self.hc_eps
        block_input = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return StreamMix(block_input, post, sinkhorn(comb, self.iters, self.hc_eps))


def merge_streams(streams: torch.Tensor, block_output: torch.Tensor, mix: StreamMix) -> torch.Tensor:
    """Streams [B, S, n, hidden] after a block: post spreads its output, comb^T mixes the streams
    (new_k = sum_j comb[j, k] * stream_j: the sum runs over comb's FIRST index)."""
    dtype = streams.dtype
    spread = mix.post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2)
    return spread + torch.matmul(mix.comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The final collapse of the streams: sigmoid weights from the flattened streams, no mixing."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        self.hc_eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mix = F.linear(unit_rms(streams.flatten(2).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


# ------------------------------------------------------------------------------------------------ MoE


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class ClippedMLP(nn.Module):
    """The shared expert: SwiGLU with clipped pre-activations, `moe_intermediate_size` wide."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        hidden, inner = cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clipped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Experts(nn.Module):
    """The routed experts, stacked as transformers holds them: gate_up_proj [E, 2I, hidden] (gate rows first),
    down_proj [E, hidden, I]."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        e, hidden, inner = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, inner))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, hidden], experts / weights [N, k] -> sum over k of weight * expert(x)"""
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            token, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(clipped_swiglu(gate, up, self.limit), self.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def router_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


class TopKRouter(nn.Module):
    """Experts by top-k of score + e_score_correction_bias (the bias steers the choice only)."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        self.top_k, self.scoring_func = cfg.num_experts_per_tok, cfg.scoring_func
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] (token_ids unused: HashRouter's signature) -> scores [N, E], experts [N, k]"""
        scores = router_scores(F.linear(x, self.weight), self.scoring_func)
        experts = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        return scores, experts


class HashRouter(nn.Module):
    """Experts by a fixed table of the input token id (tid2eid [vocab, k]); the router still weighs them."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        self.scoring_func = cfg.scoring_func
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return router_scores(F.linear(x, self.weight), self.scoring_func), self.tid2eid[token_ids].long()


class V4MoE(nn.Module):
    def __init__(self, cfg: V4Config, layer: int):
        super().__init__()
        self.scaling = cfg.routed_scaling_factor
        self.gate = HashRouter(cfg) if cfg.mlp_layer_types[layer] == HASH_MOE else TopKRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = ClippedMLP(cfg)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden], token_ids [B, S] -> [B, S, hidden]"""
        flat = x.flatten(0, 1)
        scores, experts = self.gate(flat, token_ids.flatten())
        chosen = scores.gather(1, experts)
        # NOTE: always normalised over the chosen k, as transformers does (`norm_topk_prob` is not read)
        weights = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        return self.experts(flat, experts, weights).view_as(x) + self.shared_experts(x)


# ------------------------------------------------------------------------------------------------ model


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: V4Config, layer: int):
        super().__init__()
        self.self_attn = V4Attention(cfg, layer)
        self.mlp = V4MoE(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor, rotations: Rotations,
                rows: torch.Tensor | None = None, q_pos: torch.Tensor | None = None,
                key_pos: torch.Tensor | None = None) -> torch.Tensor:
        """streams [B, n, hc_mult, hidden] -> the same. Without `rows`: the tokens are positions 0..n-1 and
        attend to each other. With `rows` [B, T, row_width] (this layer's rows of positions 0..T-1, the
        ones of other positions filled in, e.g. reused): the tokens are positions q_pos [n], their rows are
        written into `rows` at q_pos, and they attend over all of them."""
        mix = self.attn_hc(streams)
        x = self.input_layernorm(mix.block_input)
        if rows is None:
            out = self.self_attn(x, rotations)
        else:
            rows[:, q_pos] = self.self_attn.rows(x).to(rows.dtype)
            out = self.self_attn.attend(x, rows, q_pos, key_pos, rotations)
        streams = merge_streams(streams, out, mix)
        mix = self.ffn_hc(streams)
        return merge_streams(streams, self.mlp(self.post_attention_layernorm(mix.block_input), token_ids), mix)


class V4Backbone(nn.Module):
    def __init__(self, cfg: V4Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, cfg: V4Config):
        super().__init__()
        self.config = cfg
        self.model = V4Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rotations(self, n: int, device) -> Rotations:
        cfg = self.config
        return Rotations(main=rotary_table(cfg.main_rope, 1.0, n, device),
                         compress=rotary_table(cfg.compress_rope, cfg.compress_attention_factor, n, device))

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [B, S] (or [S]) at positions 0..S-1 -> float32 logits [B, S, vocab] (or [S, vocab])."""
        squeeze = token_ids.dim() == 1
        token_ids = token_ids.reshape(-1, token_ids.shape[-1]).to(self.lm_head.weight.device)
        rotations = self.rotations(token_ids.shape[1], token_ids.device)
        x = self.model.embed_tokens(token_ids)
        streams = x.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()  # [B, S, n, hidden]
        for layer in self.model.layers:
            streams = layer(streams, token_ids, rotations)
        logits = self.lm_head(self.model.norm(self.model.hc_head(streams))).float()
        return logits[0] if squeeze else logits

    def new_rows(self, n: int) -> list[torch.Tensor]:
        """Empty per-layer rows [n, row_width] for a sequence of n positions (`prefill`)."""
        w = self.lm_head.weight
        return [w.new_zeros(n, layer.self_attn.row_width) for layer in self.model.layers]

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, compute: torch.Tensor, rows: list[torch.Tensor],
                key_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Compute the positions `compute` [n] (increasing) of one sequence token_ids [T], given every other
        position's per-layer rows in `rows` (a list of [T, row_width], from `new_rows`; e.g. rows another
        prompt computed for the same content at other positions). The computed positions' rows are written
        into `rows`. -> float32 logits [n, vocab] of the computed positions.

        This is position-independent reuse for V4 (docs/deepseek-v4.md): a row holds a token's key with its
        rope slice un-rotated and its compressors' pooling inputs, so reused rows are read at their new
        positions and compressed entries are pooled at the new prompt's window alignment. key_pos [T]: the
        position each key is rotated at (default its own; the `naive` baseline passes where it was computed)."""
        compute = compute.to(token_ids.device)
        return self.logits(self.prefill_hidden(token_ids[compute], compute, rows, key_pos))

    @torch.inference_mode()
    def prefill_hidden(self, token_ids: torch.Tensor, compute: torch.Tensor, rows: list[torch.Tensor],
                       key_pos: torch.Tensor | None = None) -> torch.Tensor:
        """`prefill` given the computed positions' own token ids [n]; -> the final hidden states [n, hidden]
        (after the hyper head and the norm, before lm_head)."""
        device = self.lm_head.weight.device
        token_ids, compute = token_ids.to(device), compute.to(device)
        key_pos = None if key_pos is None else key_pos.to(device)
        span = rows[0].shape[0] if key_pos is None else max(rows[0].shape[0], int(key_pos.max()) + 1)
        rotations = self.rotations(span, device)
        chosen = token_ids[None]
        streams = self.model.embed_tokens(chosen).unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for layer, layer_rows in zip(self.model.layers, rows):
            streams = layer(streams, chosen, rotations, layer_rows[None], compute, key_pos)
        return self.model.norm(self.model.hc_head(streams))[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


# ------------------------------------------------------------------------------------------------ loading

# DeepSeek's checkpoint names -> transformers' module names, applied in order to a key without its "model."
# prefix (transformers' conversion_mapping.py holds the same table). Keys already in transformers' names pass
# through unchanged.
_RENAMES = [(re.compile(a), b) for a, b in (
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.self_attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.w1\.weight$", ".gate_proj.weight"),
    (r"\.w2\.weight$", ".down_proj.weight"),
    (r"\.w3\.weight$", ".up_proj.weight"),
)]
_ONE_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# float32 whatever the model dtype, as transformers' `_keep_in_fp32_modules_strict` (matched as substrings)
_FP32_PARTS = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias", "norm")
_PLAIN_DTYPES = ("F32", "BF16", "F16", "F64")
_DEQUANTIZE = "dequantize the checkpoint to bf16 first (this loader reads bf16/fp16/fp32 weights only)"


def module_name(key: str) -> str | None:
    """The parameter a checkpoint key fills, in transformers' names; None for multi-token-prediction weights."""
    key = key.removeprefix("model.")
    if key.startswith("mtp."):
        return None
    for pattern, replacement in _RENAMES:
        key = pattern.sub(replacement, key)
    return key if key.startswith("lm_head.") else "model." + key


def _read_weights(path: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under its module name, per-expert weights stacked; quantized ones refused."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    name = module_name(key)
                    if name is None:
                        continue
                    disk_dtype = f.get_slice(key).get_dtype()
                    quant_scale = key.endswith("scale_inv") or (key.endswith("scale") and name not in expected)
                    if quant_scale or (disk_dtype not in _PLAIN_DTYPES and not key.endswith("tid2eid")):
                        raise CheckpointError(f"{file.name}: {key} ({disk_dtype}) is a quantized weight or its "
                                              f"scale (FP8/FP4); {_DEQUANTIZE}")
                    tensors[name] = f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file} is not a readable safetensors file ({e}): it may be truncated, or hold "
                                  f"a dtype this safetensors cannot read (FP4?); {_DEQUANTIZE}") from None
    return _stack_experts(tensors)


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down weights -> transformers' stacks gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key in [k for k in tensors if _ONE_EXPERT.match(k)]:
        prefix, e, kind = _ONE_EXPERT.match(key).groups()
        per_expert.setdefault(prefix, {}).setdefault(kind, {})[int(e)] = tensors.pop(key)
    for prefix, kinds in per_expert.items():
        n = 1 + max(max(d) for d in kinds.values())
        for kind in ("gate_proj", "up_proj", "down_proj"):
            missing = [e for e in range(n) if e not in kinds.get(kind, {})]
            if missing:
                raise CheckpointError(f"weights missing for {prefix}.{missing[0]}.{kind}.weight")
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([kinds["gate_proj"][e], kinds["up_proj"][e]]) for e in range(n)])
        tensors[f"{prefix}.down_proj"] = torch.stack([kinds["down_proj"][e] for e in range(n)])
    return tensors


def load_deepseek_v4(path: str | Path, dtype: str | torch.dtype = "float32",
                     device: str = "cpu") -> DeepseekV4ForCausalLM:
    """A DeepSeek-V4 checkpoint directory (config.json + *.safetensors, sharded or not) as a model in eval mode.
    Norms, hyper-connections, sinks, position biases and the router bias stay float32 whatever `dtype`."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} holds no config.json; is it a checkpoint directory?")
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / 'config.json'} is not valid JSON ({e})") from None
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"{path}: config.json declares quantized weights ({method}); {_DEQUANTIZE}")
    cfg = V4Config.from_dict(raw)
    dtype = resolve_dtype(dtype)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    expected = model.state_dict()
    tensors = _read_weights(path, expected)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    missing = [k for k in expected if k not in tensors]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{path}: weights missing for {shown}; is config.json the one for these weights?")
    unexpected = [k for k in tensors if k not in expected]
    if unexpected:
        raise CheckpointError(f"{path}: {unexpected[0]} has no place in the model config.json describes "
                              f"({len(unexpected)} such weights); is config.json the one for these weights?")
    state = {}
    for key, ref in expected.items():
        t = tensors[key]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{path}: {key} has shape {tuple(t.shape)} but config.json implies {tuple(ref.shape)}")
        if not t.is_floating_point():  # tid2eid: expert ids
            state[key] = t.to(device=device, dtype=torch.long)
        else:
            keep_fp32 = any(part in key for part in _FP32_PARTS)
            state[key] = t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


# ------------------------------------------------------------------------------------------------ tiny checkpoints

TINY_V4 = dict(
    vocab_size=300, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    head_dim=32, partial_rotary_factor=0.25, q_lora_rank=24, o_groups=2, o_lora_rank=16, sliding_window=8,
    compress_rates={CSA: 4, HCA: 16}, index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=2,
    n_routed_experts=4, num_experts_per_tok=2, swiglu_limit=1.5, max_position_embeddings=4096,
    layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=[HASH_MOE, HASH_MOE, TOPK_MOE, TOPK_MOE],
    bos_token_id=256, eos_token_id=257,
)
# YaRN on the compress rotary: with rope dim 8 and theta 160000, the ramp spans frequencies 1..3
TINY_V4_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                "beta_fast": 32, "beta_slow": 1}


def _random_value(name: str, like: torch.Tensor, cfg, gen: torch.Generator) -> torch.Tensor:
    """Random weights large enough that every part moves the output (transformers' init leaves sinks,
    position biases and hyper-connection biases at zero, scales and norms at one, tid2eid at expert 0)."""
    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(like.shape, generator=gen) * std + mean

    if name.endswith("tid2eid"):  # k distinct experts per token id
        return torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen).argsort(-1)[:, : like.shape[1]]
    if name.endswith(("sinks", "position_bias")):
        return normal(1.0)
    if name.endswith(("e_score_correction_bias", "base", "hc_base")):
        return normal(0.5)
    if name.endswith(("norm.weight", "scale", "hc_scale")):
        return normal(0.2, mean=1.0)
    if name.endswith(("hc.fn", "hc_fn")):
        return normal(0.1)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    return normal(0.15)  # projections, routers, experts, LM head


def make_tiny_v4_checkpoint(path: str | Path, seed: int = 0, **overrides) -> Path:
    """A random tiny DeepSeek-V4 checkpoint written by transformers itself (`DeepseekV4Config` from TINY_V4 and
    overrides, `DeepseekV4ForCausalLM.save_pretrained`). Pass `rope_parameters=TINY_V4_YARN` for YaRN."""
    from transformers import DeepseekV4Config
    from transformers import DeepseekV4ForCausalLM as TransformersV4

    from irminsul.model.tiny import write_tokenizer

    path = Path(path)
    config = DeepseekV4Config(**{**TINY_V4, **overrides})
    model = TransformersV4(config)
    gen = torch.Generator().manual_seed(seed)
    state = {name: _random_value(name, t, config, gen).to(t.dtype) for name, t in model.state_dict().items()}
    model.load_state_dict(state)
    model.save_pretrained(path)
    write_tokenizer(path, config.vocab_size)  # byte-level, so LLM and the server can run it
    return path
