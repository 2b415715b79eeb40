"""DeepSeek-V4, following transformers' `models/deepseek_v4/modeling_deepseek_v4.py` (5.24) and the V4 paper's
section numbers quoted there.

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

Modules: config.py (the config and the two rotaries), attention.py (attention, compressors, indexer, the
per-token rows), blocks.py (hyper-connections, MoE), model.py (the decoder: the full forward, and `prefill`
over per-token rows, some of them reused from other positions: docs/deepseek-v4.md), loader.py (checkpoints,
tiny random ones). `irminsul/model/v4_serving.py` puts it behind the engine. Attention builds the full
[heads, S, S + entries] score matrix and re-pools every compressed entry from the rows: a reference path.
"""

from irminsul.model.deepseek_v4.attention import (
    CSACompressor,
    HCACompressor,
    Indexer,
    RMSNorm,
    V4Attention,
    WindowPool,
    sink_attention,
)
from irminsul.model.deepseek_v4.blocks import HyperConnection, HyperHead, V4MoE
from irminsul.model.deepseek_v4.config import (
    CSA,
    HASH_MOE,
    HCA,
    SLIDING,
    TOPK_MOE,
    Rotations,
    V4Config,
    rotary_table,
    rotate_tail,
)
from irminsul.model.deepseek_v4.loader import (
    TINY_V4,
    TINY_V4_YARN,
    load_deepseek_v4,
    make_tiny_v4_checkpoint,
    module_name,
)
from irminsul.model.deepseek_v4.model import DeepseekV4ForCausalLM, V4DecoderLayer

__all__ = [
    "CSA",
    "CSACompressor",
    "DeepseekV4ForCausalLM",
    "HASH_MOE",
    "HCA",
    "HCACompressor",
    "HyperConnection",
    "HyperHead",
    "Indexer",
    "RMSNorm",
    "Rotations",
    "SLIDING",
    "TOPK_MOE",
    "TINY_V4",
    "TINY_V4_YARN",
    "V4Attention",
    "V4Config",
    "V4DecoderLayer",
    "V4MoE",
    "WindowPool",
    "load_deepseek_v4",
    "make_tiny_v4_checkpoint",
    "module_name",
    "rotary_table",
    "rotate_tail",
    "sink_attention",
]
