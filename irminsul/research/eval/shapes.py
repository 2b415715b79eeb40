"""Model shapes for analytic studies: HF `config.json` contents of the production-size models.

DeepSeek-V2-Lite is `deepseek-ai/DeepSeek-V2-Lite/config.json` (docs/design.md §2: 27 layers,
16 heads, kv_lora_rank 512, rope 64, YaRN factor 40, 64 routed + 2 shared experts, top 6, first
layer dense). The GQA model of similar scale follows `Qwen/Qwen3-32B/config.json` (64 layers,
64 query heads, 8 KV heads of 128, SwiGLU 25600); its q/k norms are elementwise and not counted.
"""

from __future__ import annotations

import json
from pathlib import Path

DEEPSEEK_V2_LITE = dict(
    model_type="deepseek_v2",
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    topk_method="greedy",
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_theta=10000,
    tie_word_embeddings=False,
    rope_scaling={
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
)

QWEN3_32B = dict(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=5120,
    intermediate_size=25600,
    num_hidden_layers=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000,
    tie_word_embeddings=False,
)


def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
