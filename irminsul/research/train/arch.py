"""HF configs of the two reference models: DeepSeek-V2 (MLA + MoE) and its Llama (GQA) twin; and of a
DeepSeek-V4 of the same width and depth.

Same width, depth, vocabulary and context for both, so architecture comparisons (ROC invariance,
correction cost, quality) differ only in attention and FFN. MLA numbers follow DeepSeek-V2
(arXiv:2405.04434) scaled down: kv_lora_rank : qk_rope_head_dim = 8 : 1 (512 : 64 in the paper).
"""

from dataclasses import dataclass

from irminsul.model.chat_format import BOS, END, PAD


@dataclass(frozen=True)
class ReferenceShape:
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2  # GQA twin only
    kv_lora_rank: int = 128
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 32
    # = qk_nope + qk_rope: torch's CPU SDPA takes its fused kernel only when q, k and v share a
    # head dim (4x faster at 2k tokens than the math fallback on this machine).
    v_head_dim: int = 48
    dense_intermediate: int = 768
    moe_intermediate: int = 128
    routed_experts: int = 8
    experts_per_tok: int = 2
    shared_experts: int = 1
    max_positions: int = 2048
    # tied input/output embeddings: copying a token then needs no per-token output map, only
    # an attention head whose value/output path roughly preserves the embedding
    tie_embeddings: bool = True

    def __post_init__(self):
        assert self.kv_lora_rank == 8 * self.qk_rope_head_dim, "keep the paper's 8:1 split"
        assert self.hidden % self.heads == 0 and self.heads % self.kv_heads == 0


def hf_config(arch: str, tok, shape: ReferenceShape = ReferenceShape()):
    """A transformers config for `arch` ("mla" or "gqa") sized for tokenizer `tok`."""
    common = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=shape.tie_embeddings,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(END),
        pad_token_id=tok.token_to_id(PAD),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if arch == "mla":
        from transformers import DeepseekV2Config

        return DeepseekV2Config(
            **common,
            num_key_value_heads=shape.heads,
            intermediate_size=shape.dense_intermediate,
            kv_lora_rank=shape.kv_lora_rank,
            q_lora_rank=None,
            qk_rope_head_dim=shape.qk_rope_head_dim,
            qk_nope_head_dim=shape.qk_nope_head_dim,
            v_head_dim=shape.v_head_dim,
            first_k_dense_replace=1,  # layer 0 dense, layers 1.. MoE (as DeepSeek-V2)
            n_routed_experts=shape.routed_experts,
            num_experts_per_tok=shape.experts_per_tok,
            n_shared_experts=shape.shared_experts,
            moe_intermediate_size=shape.moe_intermediate,
            topk_method="greedy",
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            architectures=["DeepseekV2ForCausalLM"],
        )
    if arch == "gqa":
        from transformers import LlamaConfig

        # Dense FFN sized to the MoE model's *active* FFN width, so compute per token matches.
        return LlamaConfig(
            **common,
            num_key_value_heads=shape.kv_heads,
            head_dim=shape.hidden // shape.heads,
            intermediate_size=shape.dense_intermediate,
            architectures=["LlamaForCausalLM"],
        )
    if arch == "v4":
        return _v4_config(tok, shape)
    raise ValueError(f"unknown arch {arch!r}; use 'mla', 'gqa' or 'v4'")


def _v4_config(tok, shape: ReferenceShape):
    """A DeepSeek-V4 of the reference width and depth (reuse under compressed attention): a
    64-token window, so that what lies further back is read through compressed entries (CSA every 4
    tokens, HCA every 32), one layer of each kind and a last CSA layer, hash routing in the first."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        head_dim=64,
        partial_rotary_factor=0.25,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=64,
        sliding_window=64,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
        layer_types=(
            [
                "heavily_compressed_attention",
                "compressed_sparse_attention",
                "sliding_attention",
                "compressed_sparse_attention",
            ]
            * shape.layers
        )[: shape.layers],
        mlp_layer_types=["hash_moe"] + ["moe"] * (shape.layers - 1),
        index_n_heads=4,
        index_head_dim=32,
        index_topk=16,
        hc_mult=2,
        n_routed_experts=shape.routed_experts,
        num_experts_per_tok=shape.experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(END),
        pad_token_id=tok.token_to_id(PAD),
        architectures=["DeepseekV4ForCausalLM"],
    )


def build_model(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)
