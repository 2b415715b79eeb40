"""Tiny random DeepSeek-V2 / V3 checkpoints in HF format, for tests and benchmarks.

`make_tiny_checkpoint(dir, variant="v2", **overrides)` writes config.json, model.safetensors and a
byte-level tokenizer (256 byte tokens + specials, no merges), so every code path that loads a real
checkpoint is exercised without downloading anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from irminsul.model.chat_format import BOS, END, EOS, ROLE_TOKENS
from irminsul.model.config import ModelConfig
from irminsul.model.deepseek import DeepseekModel

# the bundled chat format's tokens, in the tiny tokenizers' id order (no pad token)
SPECIALS = [BOS, EOS, *ROLE_TOKENS.values(), END]

BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=4096,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=256,
    eos_token_id=257,
    rope_theta=10000.0,
)
VARIANTS = {
    "v2": dict(
        model_type="deepseek_v2",
        architectures=["DeepseekV2ForCausalLM"],
        topk_method="greedy",
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
    ),
    "v3": dict(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        topk_method="noaux_tc",
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_interleave=True,
    ),
    # LongCat-Flash: blocks of two MLA sublayers + two MLPs + a shortcut MoE with identity experts
    "longcat": dict(
        model_type="longcat_flash",
        architectures=["LongcatFlashForCausalLM"],
        q_lora_rank=24,
        routed_scaling_factor=2.0,
        zero_expert_num=2,
    ),
    # DeepSeek-V3.2: V3 plus the DSA lightning indexer (its own cached key, top-k keys per query)
    "v32": dict(
        model_type="deepseek_v32",
        architectures=["DeepseekV32ForCausalLM"],
        topk_method="noaux_tc",
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        q_lora_rank=24,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=16,
    ),
    # GLM-4.7-Flash (glm4_moe_lite): V3's MLA and routing, per-layer MLP kinds, query LoRA
    "glm": dict(
        model_type="glm4_moe_lite",
        architectures=["Glm4MoeLiteForCausalLM"],
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.8,
        rope_interleave=True,
        q_lora_rank=24,
    ),
}
YARN = {
    "type": "yarn",
    "rope_type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


def tiny_config(variant: str = "v2", yarn: bool = False, **overrides) -> dict:
    raw = {**BASE, **VARIANTS[variant], **overrides}
    if raw["model_type"] == "longcat_flash":  # its own names; num_layers blocks of two MLA sublayers
        for ours, theirs in (
            ("intermediate_size", "ffn_hidden_size"),
            ("moe_intermediate_size", "expert_ffn_hidden_size"),
            ("num_experts_per_tok", "moe_topk"),
        ):
            raw[theirs] = raw.pop(ours)
        raw["num_layers"] = raw.pop("num_hidden_layers") if "num_layers" not in overrides else raw.pop("num_layers")
        for unused in ("first_k_dense_replace", "n_shared_experts"):
            raw.pop(unused, None)
        raw["head_dim"] = raw["qk_rope_head_dim"]  # transformers sizes LongCat's RoPE by head_dim
    if raw["model_type"] == "glm4_moe_lite" and "mlp_layer_types" not in overrides:
        k, n = raw.pop("first_k_dense_replace"), raw["num_hidden_layers"]  # GLM names it per layer
        raw["mlp_layer_types"] = ["dense"] * k + ["sparse"] * (n - k)
    if yarn:
        raw["rope_scaling"] = dict(YARN)
    return raw


def byte_tokenizer(vocab_size: int) -> Tokenizer:
    """256 byte tokens (GPT-2 byte-to-unicode alphabet) + SPECIALS, padded to vocab_size."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_map = {b: ch for b, ch in zip(range(256), sorted(alphabet, key=_byte_order))}
    vocab = {byte_map[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size() <= vocab_size
    return tok


def _byte_order(ch: str) -> int:
    # Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+i.
    code = ord(ch)
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def write_tokenizer(path: Path, vocab_size: int) -> None:
    byte_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
    from irminsul.model.chat_format import IRMINSUL_CHAT_TEMPLATE

    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "chat_template": IRMINSUL_CHAT_TEMPLATE},
            indent=1,
        )
    )


def make_tiny_checkpoint(
    path: str | Path,
    variant: str = "v2",
    yarn: bool = False,
    seed: int = 0,
    std: float = 0.1,
    shards: int = 1,
    **overrides,
) -> Path:
    """Write a random tiny checkpoint to `path` and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = tiny_config(variant, yarn, **overrides)
    cfg = ModelConfig.from_dict(raw)
    torch.manual_seed(seed)
    model = DeepseekModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    if cfg.zero_expert_num:
        state = _fuse_experts(state, cfg)
    _save(path, state, shards)
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    write_tokenizer(path, cfg.vocab_size)
    return path


def _zero_expert_rows() -> bool:
    """Whether the installed transformers' LongCat keeps rows for its zero-computation experts in the
    fused gate_up ([routed + zero, 2I, H], unused: up to 5.24) or not ([routed, 2I, H]: 5.25 on);
    its parameter's shape, read from an instance on the meta device."""
    try:
        from transformers import LongcatFlashConfig
        from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts
    except ImportError:
        return False
    probe = LongcatFlashConfig(n_routed_experts=2, zero_expert_num=1, hidden_size=8, expert_ffn_hidden_size=4)
    with torch.device("meta"):
        return LongcatFlashExperts(probe).gate_up_proj.shape[0] > 2


def _fuse_experts(state: dict, cfg: ModelConfig) -> dict:
    """LongCat's experts as the installed transformers stores them: gate_up [routed (+ zero experts,
    their rows zero: `_zero_expert_rows`), 2I, H], down [routed, H, I]. Irminsul's loader reads either
    (`loader._unfuse_experts` unfolds every row; the model has no expert past the routed ones to load
    the zero rows into)."""
    out = {}
    zero_rows = _zero_expert_rows()
    for b in range(cfg.num_blocks):
        prefix = f"model.layers.{b}.mlp.experts"
        gate_up = [
            torch.cat([state.pop(f"{prefix}.{e}.gate_proj.weight"), state.pop(f"{prefix}.{e}.up_proj.weight")])
            for e in range(cfg.n_routed_experts)
        ]
        gate_up += [torch.zeros_like(gate_up[0])] * (cfg.zero_expert_num if zero_rows else 0)
        out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.down_proj"] = torch.stack(
            [state.pop(f"{prefix}.{e}.down_proj.weight") for e in range(cfg.n_routed_experts)]
        )
    return {**state, **out}


def _save(path: Path, state: dict, shards: int) -> None:
    if shards == 1:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i::shards]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
