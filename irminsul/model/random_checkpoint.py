"""`irminsul checkpoint random OUT --family F`: a random-weight checkpoint of any supported family and size.

For trying the engine, the server and the studies without downloading weights. The checkpoint is a
real HF directory (config.json, safetensors, the byte-level tokenizer and the bundled chat template),
built from the tiny test configs (`tiny.py`; `deepseek_v4/loader.py` for V4) with the sizes given
here, and checked by the same config readers `irminsul serve` and `LLM()` use before any weight is
drawn. Its outputs are noise: it measures speed and memory, not quality.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from irminsul.cli import at_least
from irminsul.errors import UserFacingError
from irminsul.model.registry import FAMILIES

# model_type -> the tiny config it starts from (tiny.VARIANTS; V4 has its own)
VARIANT = {
    "deepseek_v2": "v2",
    "deepseek_v3": "v3",
    "deepseek_v32": "v32",
    "glm4_moe_lite": "glm",
    "longcat_flash": "longcat",
    "deepseek_v4": "v4",
}
V4_LAYER_CYCLE = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
)  # TINY_V4's layer kinds, repeated for more layers
V4_HASH_LAYERS = 2  # TINY_V4's first two MoE layers route by token id
# option -> the MLA config key it sets (MLA families only)
_MLA_HEAD_OPTIONS = {
    "kv_lora_rank": "kv_lora_rank",
    "rope_head_dim": "qk_rope_head_dim",
    "nope_head_dim": "qk_nope_head_dim",
    "v_head_dim": "v_head_dim",
}


def register(sub) -> None:
    p = sub.add_parser("checkpoint", help="make checkpoints to try things with")
    kinds = p.add_subparsers(dest="checkpoint_command", required=True)
    r = kinds.add_parser(
        "random",
        help="write a random-weight checkpoint of any supported family and size",
        description="Write a random-weight checkpoint (config.json, model.safetensors, "
        "tokenizer.json, tokenizer_config.json with the bundled chat template) "
        "that `irminsul serve --model OUT` and LLM(OUT) load. Sizes left out "
        "are the tiny test model's.",
    )
    r.add_argument("out", help="directory to write (must not exist, or be empty)")
    r.add_argument("--family", required=True, choices=list(FAMILIES), help="the model_type")
    r.add_argument("--layers", type=at_least(1), help="decoder layers (longcat_flash: blocks of two MLA sublayers)")
    r.add_argument("--hidden", type=at_least(1), help="hidden size (the MLPs scale with it)")
    r.add_argument("--heads", type=at_least(1), help="attention heads")
    r.add_argument(
        "--vocab", type=at_least(1), help="vocabulary size (at least the byte tokenizer's 256 bytes + special tokens)"
    )
    r.add_argument("--experts", type=at_least(1), help="routed experts per MoE layer")
    r.add_argument(
        "--experts-per-token",
        type=at_least(1),
        help="routed experts each token is sent to (num_experts_per_tok; longcat_flash: moe_topk)",
    )
    r.add_argument(
        "--shared-experts",
        type=at_least(1),
        help="shared experts every token runs (n_shared_experts; not longcat_flash or deepseek_v4)",
    )
    r.add_argument("--kv-lora-rank", type=at_least(1), help="the cached latent's width (MLA families)")
    r.add_argument(
        "--rope-head-dim", type=at_least(2), help="qk_rope_head_dim: the RoPE key's width, k_r (MLA families; even)"
    )
    r.add_argument("--nope-head-dim", type=at_least(1), help="qk_nope_head_dim (MLA families)")
    r.add_argument("--v-head-dim", type=at_least(1), help="v_head_dim (MLA families)")
    r.add_argument("--context", type=at_least(1), help="max_position_embeddings")
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the stored weights")
    r.add_argument("--shards", type=at_least(1), default=1, help="safetensors files (more than 1 adds the index)")
    r.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    r.set_defaults(func=run)


def run(args) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserFacingError(f"{out} exists and is not an empty directory; name a new one")
    config = random_config(args)
    if args.family == "deepseek_v4":
        from irminsul.model.deepseek_v4.loader import make_tiny_v4_checkpoint

        make_tiny_v4_checkpoint(out, seed=args.seed, **config)
    else:
        from irminsul.model.tiny import make_tiny_checkpoint

        hidden = config.get("hidden_size", 64)
        # std 0.1 at the tiny hidden size of 64, scaled so wider layers keep their activations' size
        make_tiny_checkpoint(
            out, VARIANT[args.family], seed=args.seed, std=0.1 * math.sqrt(64 / hidden), shards=args.shards, **config
        )
    v4 = args.family == "deepseek_v4"  # (transformers wrote it: one file, float32)
    n = _finish_weights(out, args.dtype, args.shards, rewrite=args.dtype != "float32" or (v4 and args.shards > 1))
    print(
        f"wrote {out}: {args.family}, {n / 1e6:.1f} M parameters in {args.dtype}, random weights; "
        f"serve it with `irminsul serve --model {out}`"
    )
    return 0


def random_config(args: argparse.Namespace) -> dict:
    """The config overrides the options ask for, checked by the family's own config reader (a
    one-line error for a combination no checkpoint of the family can have)."""
    family, o = args.family, {}
    if args.hidden is not None:
        o.update(hidden_size=args.hidden, moe_intermediate_size=max(1, args.hidden // 2))
        if family != "deepseek_v4":
            o["intermediate_size"] = 2 * args.hidden
    for option, key in (
        ("heads", "num_attention_heads"),
        ("vocab", "vocab_size"),
        ("experts", "n_routed_experts"),
        ("context", "max_position_embeddings"),
        ("experts_per_token", "num_experts_per_tok"),
        ("shared_experts", "n_shared_experts"),
    ):
        if getattr(args, option, None) is not None:  # (getattr: callers' Namespaces may predate an option)
            o[key] = getattr(args, option)
    if "n_shared_experts" in o and family in ("longcat_flash", "deepseek_v4"):
        raise UserFacingError(
            f"--shared-experts does not apply to {family}: its shared part is fixed by the "
            "architecture (LongCat: identity experts; V4: one shared expert)"
        )
    if args.heads is not None and family != "deepseek_v4":
        o["num_key_value_heads"] = args.heads  # (MLA: as many as the query heads)
    if args.vocab is not None:
        from irminsul.model.tiny import SPECIALS

        if args.vocab < 256 + len(SPECIALS):
            raise UserFacingError(
                f"--vocab {args.vocab}: the byte-level tokenizer needs at least "
                f"{256 + len(SPECIALS)} ids (256 bytes and {len(SPECIALS)} special tokens)"
            )
    if family == "deepseek_v4":
        for option in _MLA_HEAD_OPTIONS:
            if getattr(args, option, None) is not None:
                flag = "--" + option.replace("_", "-")
                raise UserFacingError(
                    f"{flag} does not apply to deepseek_v4: it is not MLA (one shared key/value head per layer)"
                )
        if args.layers is not None:
            n = args.layers
            o.update(
                num_hidden_layers=n,
                layer_types=[V4_LAYER_CYCLE[i % len(V4_LAYER_CYCLE)] for i in range(n)],
                mlp_layer_types=["hash_moe" if i < V4_HASH_LAYERS else "moe" for i in range(n)],
            )
        _check_v4(o)
        return o
    for option, key in _MLA_HEAD_OPTIONS.items():
        if getattr(args, option, None) is not None:  # (getattr: callers' Namespaces may predate an option)
            o[key] = getattr(args, option)
    if getattr(args, "rope_head_dim", None) is not None:
        if args.rope_head_dim % 2:
            raise UserFacingError(f"--rope-head-dim {args.rope_head_dim}: RoPE rotates pairs, so it must be even")
    if family in ("deepseek_v3", "deepseek_v32"):
        # written out, as DeepSeek-V3's own config.json does: readers that do not infer it from the
        # model type (vLLM's DeepSeek MoE defaults to softmax) then route as Irminsul and HF do
        o["scoring_func"] = "sigmoid"
    if args.layers is not None:
        o["num_layers" if family == "longcat_flash" else "num_hidden_layers"] = args.layers
        if family != "longcat_flash" and args.layers < 2:
            o["first_k_dense_replace"] = 0  # (one layer: an MoE layer, so the routing is in the checkpoint)
    _check_mla(family, o)
    return o


def _check_mla(family: str, overrides: dict) -> None:
    from irminsul.model.config import ModelConfig
    from irminsul.model.tiny import tiny_config

    raw = tiny_config(VARIANT[family], **overrides)
    try:
        ModelConfig.from_dict(raw)
    except UserFacingError as e:
        raise UserFacingError(f"{family} cannot have these sizes: {_plain(e)}") from None
    groups, top_k = raw.get("n_group"), raw.get("num_experts_per_tok", raw.get("moe_topk"))
    if groups and raw["n_routed_experts"] // groups * raw["topk_group"] < top_k:
        raise UserFacingError(
            f"{family} cannot have these sizes: --experts {raw['n_routed_experts']} in "
            f"{groups} routing groups, {raw['topk_group']} of them chosen, leaves fewer than the "
            f"{top_k} experts each token is routed to"
        )


def _check_v4(overrides: dict) -> None:
    from irminsul.model.deepseek_v4.config import V4Config
    from irminsul.model.deepseek_v4.loader import TINY_V4

    raw = {**TINY_V4, **overrides, "model_type": "deepseek_v4"}
    try:
        cfg = V4Config.from_dict(raw)
    except UserFacingError as e:
        raise UserFacingError(f"deepseek_v4 cannot have these sizes: {_plain(e)}") from None
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise UserFacingError(
            f"deepseek_v4 cannot have these sizes: --experts {cfg.n_routed_experts} is fewer than "
            f"the {cfg.num_experts_per_tok} experts each token is routed to"
        )


def _plain(error: Exception) -> str:
    """A config reader's message without its `config.json: ` lead (there is no file yet)."""
    return str(error).removeprefix("config.json: ")


def _finish_weights(path: Path, dtype: str, shards: int, rewrite: bool) -> int:
    """The parameter count; with `rewrite`, the weights are stored again in `dtype` and `shards` files."""
    import torch
    from safetensors.torch import load_file

    from irminsul.model.tiny import _save

    files = sorted(path.glob("*.safetensors"))
    state = {k: v for f in files for k, v in load_file(str(f)).items()}
    if rewrite:
        if dtype == "bfloat16":
            state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
        for f in files:
            f.unlink()
        (path / "model.safetensors.index.json").unlink(missing_ok=True)
        _save(path, state, shards)
    return sum(t.numel() for t in state.values())
