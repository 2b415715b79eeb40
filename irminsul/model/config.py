"""Model configuration read from an HF `config.json` (DeepSeek-V2 / V3 families).

Every field the engine relies on is validated here, so an unsupported or inconsistent checkpoint
fails at load time with a message naming the field, never three layers down in a matmul.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from irminsul.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "longcat_flash")
# Families whose routing and RoPE layout are DeepSeek-V3's (sigmoid scores with a correction bias,
# noaux_tc groups, rope_interleave): V3.2 adds its indexer; GLM-4.7-Flash is V3's MLA and MoE under
# its own config names.
V3_LIKE = ("deepseek_v3", "deepseek_v32", "glm4_moe_lite")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of the decoupled key `k_r` (width `dim`)."""

    dim: int
    theta: float
    kind: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    # Layout of the pairs rotated together (docs/design.md, section 2):
    #   "v2"            interleaved complex pairs (2i, 2i+1) in and out;
    #   "v3_interleave" interleaved pairs in, de-interleaved halves out (V3 `rope_interleave`);
    #   "v3_half"       halves (i, i + dim/2) in and out (V3 without `rope_interleave`).
    style: str = "v2"

    def __post_init__(self):
        if self.kind not in ("default", "yarn"):
            raise ConfigError(f"rope_scaling.type={self.kind!r} is not supported (use none or 'yarn')")
        if self.dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.dim} must be even")
        if self.style not in ("v2", "v3_interleave", "v3_half"):
            raise ConfigError(f"unknown RoPE style {self.style!r}")
        if self.kind == "yarn" and (self.factor <= 0 or self.original_max_position <= 0):
            raise ConfigError("rope_scaling: yarn needs factor > 0 and original_max_position_embeddings > 0")

    @property
    def cache_layout(self) -> str:
        """How pairs sit in the cached `k_r`: "interleaved" (V2) or "half" (V3)."""
        return "interleaved" if self.style == "v2" else "half"

    @property
    def attention_factor(self) -> float:
        """YaRN factor multiplied into cos/sin (HF `attention_scaling`); 1.0 for DeepSeek's configs."""
        if self.kind != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """YaRN's mscale on the softmax scale, applied squared (V2-Lite: 0.1*0.707*ln 40 + 1)."""
        if self.kind != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # MoE (layers >= first_k_dense_replace); n_routed_experts == 0 means dense everywhere.
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    mlp_layer_types: tuple[str, ...] | None = None  # GLM: "dense" | "sparse" per layer (overrides the two above)
    # LongCat-Flash: each decoder block holds two MLA sublayers (num_hidden_layers counts them, so
    # the pool has a row per sublayer), two dense MLPs and a shortcut MoE whose last
    # `zero_expert_num` experts are identities; MLA scales q and c_KV by sqrt(hidden / lora rank).
    attention_per_block: int = 1
    zero_expert_num: int = 0
    mla_lora_scale: bool = False
    # DeepSeek-V3.2's sparse attention: a lightning indexer per layer (index_n_heads heads of
    # index_head_dim, its own per-token key cached beside [c_KV | k_r]) picks index_topk keys per query
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    scoring_func: str = "softmax"  # V2: softmax, V3: sigmoid
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def num_blocks(self) -> int:
        """Decoder blocks (checkpoint `model.layers.N`): one per MLA sublayer except in LongCat."""
        return self.num_hidden_layers // self.attention_per_block

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """MLA's cached latent per token per layer: [c_KV | k_r] (DeepSeek: 512 + 64 = 576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def row_width(self) -> int:
        """One pool row per token per layer: the latent, then V3.2's indexer key (un-rotated)."""
        return self.latent_width + self.index_head_dim

    @property
    def softmax_scale(self) -> float:
        # HF >= 5.15 / DeepSeek inference/model.py: qk_head_dim^-0.5 * mscale^2.
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale**2

    def is_moe_layer(self, layer: int) -> bool:
        if self.n_routed_experts and self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer] == "sparse"
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        return _parse(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return _parse(read_json_config(Path(path)))


def _req(raw: dict, name: str, kind=int):
    if name not in raw or raw[name] is None:
        raise ConfigError(f"config.json: required field {name!r} is missing")
    value = raw[name]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ConfigError(f"config.json: {name}={value!r} must be a positive integer")
    return value


def read_json_config(file: Path) -> dict:
    """A checkpoint's config.json as a dict, else a ConfigError that says what is wrong with it."""
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{file} is missing: a checkpoint directory needs config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file} must hold a JSON object (a model config), not a {type(raw).__name__}")
    return raw


def _rope(raw: dict, model_type: str) -> RopeConfig:
    dim = _req(raw, "qk_rope_head_dim")
    # HF >= 5 writes `rope_parameters`; original checkpoints write `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    if scaling:
        params = {**params, **scaling}
    default_theta = 1e7 if model_type == "longcat_flash" else 10000.0  # transformers' defaults
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if model_type == "deepseek_v32":
        style = "v3_interleave"  # V3.2's MLA has no rope_interleave switch (its indexer is half-split)
    elif model_type in V3_LIKE:
        style = "v3_interleave" if raw.get("rope_interleave", True) else "v3_half"
    elif model_type == "longcat_flash":
        style = "v3_interleave"  # transformers applies the interleaved form unconditionally
    else:
        style = "v2"
    if kind == "default":
        return RopeConfig(dim=dim, theta=theta, style=style)
    if kind != "yarn":
        raise ConfigError(f"config.json: rope_scaling type {kind!r} is not supported (none or 'yarn')")
    if "factor" not in params:
        raise ConfigError("config.json: rope_scaling.factor is required for yarn")
    orig = params.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return RopeConfig(
        dim=dim,
        theta=theta,
        kind="yarn",
        factor=float(params["factor"]),
        original_max_position=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        truncate=bool(params.get("truncate", True)),
        style=style,
    )


def _mlp_layer_types(raw: dict, model_type: str) -> tuple[str, ...] | None:
    """GLM's per-layer MLP kinds; its default is one dense layer, then MoE (as transformers builds it).
    V3.2 configs written by transformers carry them too (derived from first_k_dense_replace)."""
    if model_type == "deepseek_v32" and raw.get("mlp_layer_types"):
        return tuple(raw["mlp_layer_types"])
    if model_type != "glm4_moe_lite":
        return None
    layers = _req(raw, "num_hidden_layers")
    kinds = raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    if len(kinds) != layers or any(k not in ("dense", "sparse") for k in kinds):
        raise ConfigError(
            f"config.json: mlp_layer_types must name 'dense' or 'sparse' for each of the {layers} layers, got {kinds!r}"
        )
    return tuple(kinds)


def _longcat(raw: dict) -> dict:
    """LongCat-Flash's config in the DeepSeek names this module reads, plus what only it has."""
    blocks = _req(raw, "num_layers")
    if raw.get("q_lora_rank") is None:
        raise ConfigError("config.json: longcat_flash needs q_lora_rank (its queries always go through a LoRA)")
    if raw.get("head_dim", raw.get("qk_rope_head_dim")) != raw.get("qk_rope_head_dim"):
        raise ConfigError(
            f"config.json: head_dim={raw.get('head_dim')} must equal qk_rope_head_dim="
            f"{raw.get('qk_rope_head_dim')} (transformers sizes LongCat's RoPE by head_dim)"
        )
    if raw.get("router_bias"):
        raise ConfigError("config.json: router_bias=true is not supported for longcat_flash")
    return {
        **raw,
        "num_hidden_layers": 2 * blocks,
        "intermediate_size": _req(raw, "ffn_hidden_size"),
        "moe_intermediate_size": _req(raw, "expert_ffn_hidden_size"),
        "num_experts_per_tok": _req(raw, "moe_topk"),
        "n_shared_experts": 0,
        "topk_method": "longcat",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "first_k_dense_replace": 0,
    }


def _parse(raw: dict) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type == "longcat_flash":
        raw = _longcat(raw)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"config.json: model_type={model_type!r} is not supported; Irminsul serves MLA models "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    heads = _req(raw, "num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ConfigError(f"config.json: num_key_value_heads={kv_heads} must equal num_attention_heads={heads} for MLA")
    q_lora = raw.get("q_lora_rank")
    if q_lora is not None:
        q_lora = _req(raw, "q_lora_rank")
    n_routed = raw.get("n_routed_experts") or 0
    is_v3 = model_type in V3_LIKE
    moe = {}
    if n_routed:
        topk = _req(raw, "num_experts_per_tok")
        if topk > n_routed:
            raise ConfigError(f"config.json: num_experts_per_tok={topk} exceeds n_routed_experts={n_routed}")
        n_group = raw.get("n_group") or 1
        topk_group = raw.get("topk_group") or 1
        topk_method = raw.get("topk_method") or ("noaux_tc" if is_v3 else "greedy")
        scoring = raw.get("scoring_func") or ("sigmoid" if is_v3 else "softmax")
        if is_v3 and scoring != "sigmoid":
            raise ConfigError(f"config.json: scoring_func={scoring!r}; {model_type} routing is 'sigmoid'")
        if model_type == "deepseek_v2" and topk_method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"config.json: topk_method={topk_method!r} is not a DeepSeek-V2 routing method")
        if n_routed % n_group:
            raise ConfigError(f"config.json: n_routed_experts={n_routed} is not divisible by n_group={n_group}")
        if topk_group > n_group:
            raise ConfigError(f"config.json: topk_group={topk_group} exceeds n_group={n_group}")
        moe = dict(
            n_routed_experts=n_routed,
            n_shared_experts=raw.get("n_shared_experts") or 0,
            num_experts_per_tok=topk,
            moe_intermediate_size=_req(raw, "moe_intermediate_size"),
            first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
            moe_layer_freq=raw.get("moe_layer_freq") or 1,
            mlp_layer_types=_mlp_layer_types(raw, model_type),
            scoring_func=scoring,
            topk_method=topk_method,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(raw.get("norm_topk_prob", is_v3)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act={raw.get('hidden_act')!r} is not supported (silu)")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    longcat = model_type == "longcat_flash"
    extra = (
        dict(attention_per_block=2, zero_expert_num=int(raw.get("zero_expert_num") or 0), mla_lora_scale=True)
        if longcat
        else {}
    )
    if model_type == "deepseek_v32":
        if q_lora is None:
            raise ConfigError("config.json: deepseek_v32 needs q_lora_rank (its indexer reads the query LoRA)")
        extra = dict(
            index_n_heads=_req(raw, "index_n_heads"),
            index_head_dim=_req(raw, "index_head_dim"),
            index_topk=_req(raw, "index_topk"),
        )
        if extra["index_head_dim"] < _req(raw, "qk_rope_head_dim"):
            raise ConfigError("config.json: index_head_dim must be at least qk_rope_head_dim")
    return ModelConfig(
        **extra,
        model_type=model_type,
        vocab_size=_req(raw, "vocab_size"),
        hidden_size=_req(raw, "hidden_size"),
        intermediate_size=_req(raw, "intermediate_size"),
        num_hidden_layers=_req(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        kv_lora_rank=_req(raw, "kv_lora_rank"),
        q_lora_rank=q_lora,
        qk_nope_head_dim=_req(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=_req(raw, "qk_rope_head_dim"),
        v_head_dim=_req(raw, "v_head_dim"),
        max_position_embeddings=_req(raw, "max_position_embeddings"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope(raw, model_type),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        **moe,
    )
