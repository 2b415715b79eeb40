"""Loading V4 checkpoints (transformers' names and DeepSeek's on-disk ones; quantized weights refused), and
the random tiny checkpoints the tests use."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from irminsul.errors import CheckpointError
from irminsul.model.deepseek_v4.config import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE, V4Config
from irminsul.model.deepseek_v4.model import DeepseekV4ForCausalLM
from irminsul.model.loader import owned, resolve_dtype, weight_files

# ------------------------------------------------------------------------------------------------ loading

# DeepSeek's checkpoint names -> transformers' module names, applied in order to a key without its "model."
# prefix (transformers' conversion_mapping.py holds the same table). Keys already in transformers' names pass
# through unchanged.
_RENAMES = [
    (re.compile(a), b)
    for a, b in (
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
    )
]
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
                        raise CheckpointError(
                            f"{file.name}: {key} ({disk_dtype}) is a quantized weight or its "
                            f"scale (FP8/FP4); {_DEQUANTIZE}"
                        )
                    tensors[name] = f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(
                f"{file} is not a readable safetensors file ({e}): it may be truncated, or hold "
                f"a dtype this safetensors cannot read (FP4?); {_DEQUANTIZE}"
            ) from None
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
            [torch.cat([kinds["gate_proj"][e], kinds["up_proj"][e]]) for e in range(n)]
        )
        tensors[f"{prefix}.down_proj"] = torch.stack([kinds["down_proj"][e] for e in range(n)])
    return tensors


def load_deepseek_v4(
    path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> DeepseekV4ForCausalLM:
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
        raise CheckpointError(
            f"{path}: {unexpected[0]} has no place in the model config.json describes "
            f"({len(unexpected)} such weights); is config.json the one for these weights?"
        )
    state = {}
    for key, ref in expected.items():
        t = tensors[key]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{path}: {key} has shape {tuple(t.shape)} but config.json implies {tuple(ref.shape)}"
            )
        if not t.is_floating_point():  # tid2eid: expert ids
            state[key] = owned(t, t.to(device=device, dtype=torch.long))
        else:
            keep_fp32 = any(part in key for part in _FP32_PARTS)
            state[key] = owned(t, t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype))
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


# ------------------------------------------------------------------------------------------------ tiny checkpoints

TINY_V4 = dict(
    vocab_size=300,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    partial_rotary_factor=0.25,
    q_lora_rank=24,
    o_groups=2,
    o_lora_rank=16,
    sliding_window=8,
    compress_rates={CSA: 4, HCA: 16},
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,
    hc_mult=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    swiglu_limit=1.5,
    max_position_embeddings=4096,
    layer_types=[SLIDING, CSA, HCA, CSA],
    mlp_layer_types=[HASH_MOE, HASH_MOE, TOPK_MOE, TOPK_MOE],
    bos_token_id=256,
    eos_token_id=257,
)
# YaRN on the compress rotary: with rope dim 8 and theta 160000, the ramp spans frequencies 1..3
TINY_V4_YARN = {
    "rope_type": "yarn",
    "factor": 16.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32,
    "beta_slow": 1,
}


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
