"""DeepSeek-V4's config as this project reads it (transformers' `DeepseekV4Config` and DeepSeek's older
spellings), and its two rotaries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from irminsul.errors import ConfigError
from irminsul.model.config import RopeConfig
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
        for name, kinds, allowed in (
            ("layer_types", self.layer_types, (SLIDING, CSA, HCA)),
            ("mlp_layer_types", self.mlp_layer_types, (HASH_MOE, TOPK_MOE)),
        ):
            if len(kinds) != n or any(k not in allowed for k in kinds):
                raise ConfigError(f"{name}={list(kinds)}: need {n} entries, each one of {allowed}")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ConfigError(f"scoring_func={self.scoring_func!r} is not supported (sqrtsoftplus, sigmoid, softmax)")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError(f"o_groups={self.o_groups} must divide num_attention_heads * head_dim")
        for rope in (self.main_rope, self.compress_rope):
            if rope.dim > min(self.head_dim, self.index_head_dim):
                raise ConfigError(f"the rotary dim {rope.dim} exceeds head_dim or index_head_dim")

    @classmethod
    def from_dict(cls, raw: dict) -> V4Config:
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
            vocab_size=raw.get("vocab_size", 129280),
            hidden_size=raw.get("hidden_size", 4096),
            num_hidden_layers=n,
            num_attention_heads=raw.get("num_attention_heads", 64),
            head_dim=head_dim,
            q_lora_rank=raw.get("q_lora_rank", 1024),
            o_groups=raw.get("o_groups", 8),
            o_lora_rank=raw.get("o_lora_rank", 1024),
            sliding_window=raw.get("sliding_window", 128),
            layer_types=tuple(layer_types[:n]),
            csa_rate=rates[CSA],
            hca_rate=rates[HCA],
            index_n_heads=raw.get("index_n_heads", 64),
            index_head_dim=raw.get("index_head_dim", 128),
            index_topk=raw.get("index_topk", 512),
            hc_mult=raw.get("hc_mult", 4),
            hc_sinkhorn_iters=raw.get("hc_sinkhorn_iters", 20),
            hc_eps=raw.get("hc_eps", 1e-6),
            mlp_layer_types=tuple(mlp_types[:n]),
            n_routed_experts=raw.get("n_routed_experts", 256),
            num_experts_per_tok=raw.get("num_experts_per_tok", 6),
            moe_intermediate_size=raw.get("moe_intermediate_size", 2048),
            scoring_func=raw.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=raw.get("routed_scaling_factor", 1.5),
            swiglu_limit=raw.get("swiglu_limit", 10.0),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            main_rope=main_rope,
            compress_rope=compress_rope,
            compress_attention_factor=compress_factor,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
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
        dim=dim,
        theta=params["rope_theta"],
        kind="yarn",
        factor=params.get("factor") or max_positions / original,
        original_max_position=original,
        beta_fast=params.get("beta_fast") or 32,
        beta_slow=params.get("beta_slow") or 1,
        mscale=params.get("mscale") or 0.0,
        mscale_all_dim=params.get("mscale_all_dim") or 0.0,
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
