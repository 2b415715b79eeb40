"""Our DeepSeek-V4 prefill (irminsul/model/deepseek_v4.py) against transformers' own modelling code."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from irminsul.errors import CheckpointError
from irminsul.model.config import RopeConfig
from irminsul.model.deepseek_v4 import (
    CSA,
    HASH_MOE,
    HCA,
    SLIDING,
    TINY_V4,
    TINY_V4_YARN,
    TOPK_MOE,
    V4Config,
    load_deepseek_v4,
    make_tiny_v4_checkpoint,
)
from irminsul.research.eval.v4_reuse import shifted_reuse_error

transformers = pytest.importorskip("transformers", minversion="5.24")

# 70 tokens: past the sliding window (8), 17 CSA windows (rate 4) of which the indexer keeps 2-4, and 4 HCA
# windows (rate 16) plus a partial one
SEQ = 70
CASES = {
    "hc2-sqrtsoftplus": {},  # TINY_V4: sliding, CSA, HCA, CSA; hash, hash, moe, moe
    "hc4-yarn-sigmoid": dict(
        rope_parameters=TINY_V4_YARN,
        hc_mult=4,
        num_hidden_layers=3,
        scoring_func="sigmoid",
        layer_types=[HCA, CSA, SLIDING],
        mlp_layer_types=[TOPK_MOE, HASH_MOE, TOPK_MOE],
    ),
    "hc3-yarn-top2": dict(
        rope_parameters=TINY_V4_YARN,
        hc_mult=3,
        index_topk=2,
        index_n_heads=4,
        o_groups=4,
        n_routed_experts=6,
        num_experts_per_tok=3,
        layer_types=[CSA, HCA, SLIDING, HCA],
        mlp_layer_types=[TOPK_MOE, HASH_MOE, TOPK_MOE, HASH_MOE],
    ),
}


def _tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, TINY_V4["vocab_size"], (batch, SEQ), generator=torch.Generator().manual_seed(0))


def _transformers_logprobs(path, ids, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(ids).logits.float().log_softmax(-1)


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    return make_tiny_v4_checkpoint(tmp_path_factory.mktemp("v4") / "ckpt", seed=1)


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_logprobs_match_transformers(tmp_path, overrides):
    from transformers import AutoModelForCausalLM

    path = make_tiny_v4_checkpoint(tmp_path / "ckpt", seed=1, **overrides)
    ours = load_deepseek_v4(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _tokens()
    with torch.no_grad():
        ref = hf(ids).logits.log_softmax(-1)
    assert (ours(ids).log_softmax(-1) - ref).abs().max().item() < 1e-4
    # the module names are transformers' in-memory ones: its state dict loads as it is
    theirs = hf.state_dict()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.items()}
    ours.load_state_dict(theirs)


PERTURBATIONS = {
    "sinks": lambda m: [layer.self_attn.sinks.zero_() for layer in m.model.layers],
    "compressor position bias": lambda m: [
        p.zero_() for n, p in m.named_parameters() if n.endswith("compressor.position_bias")
    ],
    "indexer position bias": lambda m: [
        p.zero_() for n, p in m.named_parameters() if n.endswith("indexer.position_bias")
    ],
    "indexer keeps every window": lambda m: [
        setattr(mod, "topk", 10**6) for n, mod in m.named_modules() if n.endswith("indexer")
    ],
    "hyper-connection biases": lambda m: [p.zero_() for n, p in m.named_parameters() if n.endswith("hc.base")],
    "hash table": lambda m: [
        b.copy_((b + 1) % m.config.n_routed_experts) for n, b in m.named_buffers() if n.endswith("tid2eid")
    ],
    "swiglu clipping": lambda m: [setattr(mod, "limit", 1e9) for mod in m.modules() if hasattr(mod, "limit")],
}


@pytest.mark.parametrize("perturb", PERTURBATIONS.values(), ids=PERTURBATIONS.keys())
def test_parity_is_sensitive(tiny_v4, perturb):
    """The parity above is not vacuous: each of these parts moves the log-probs well past its tolerance."""
    ids = _tokens(batch=1)
    base = load_deepseek_v4(tiny_v4)(ids).log_softmax(-1)
    model = load_deepseek_v4(tiny_v4)
    with torch.no_grad():
        perturb(model)
    assert (model(ids).log_softmax(-1) - base).abs().max().item() > 1e-3


def test_parity_is_sensitive_to_yarn(tmp_path):
    """The YaRN cases test the compress rotary's frequencies: plain RoPE at the same theta is far off."""
    path = make_tiny_v4_checkpoint(tmp_path / "ckpt", seed=1, rope_parameters=TINY_V4_YARN)
    model, ids = load_deepseek_v4(path), _tokens(batch=1)
    base = model(ids).log_softmax(-1)
    assert model.config.compress_rope.kind == "yarn"
    plain = RopeConfig(dim=model.config.compress_rope.dim, theta=model.config.compress_rope.theta)
    model.config = dataclasses.replace(model.config, compress_rope=plain)
    assert (model(ids).log_softmax(-1) - base).abs().max().item() > 1e-3


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    """A copy of checkpoint src at dst with its tensors and/or config.json edited."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    if edit_tensors:
        tensors = edit_tensors(tensors)
        (dst / "model.safetensors").unlink()
        save_file(tensors, dst / "model.safetensors")
    if edit_config:
        raw = json.loads((dst / "config.json").read_text())
        edit_config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_reads_deepseek_release_names(tiny_v4, tmp_path):
    """DeepSeek's release names (no `model.` prefix, `embed`, `head`, `hc_head_fn`, MTP layers) load too."""

    def release_names(tensors):
        out = {
            k.removeprefix("model.").replace("embed_tokens.", "embed.").replace("hc_head.hc_", "hc_head_"): v
            for k, v in tensors.items()
        }
        out["mtp.0.attn.wq_a.weight"] = torch.zeros(3, 3)
        return out

    path = _rewrite(tiny_v4, tmp_path / "release", release_names)
    assert "hc_head_fn" in load_file(path / "model.safetensors")
    ids = _tokens(batch=1)
    assert torch.equal(load_deepseek_v4(path)(ids), load_deepseek_v4(tiny_v4)(ids))


def test_legacy_config_keys_read_as_transformers_reads_them():
    """DeepSeek's own config.json spelling (per-layer compress_ratios, flat rope_scaling, num_hash_layers,
    qk_rope_head_dim) gives the same model as transformers' normalised, saved config."""
    from transformers import DeepseekV4Config

    legacy = {
        k: v
        for k, v in TINY_V4.items()
        if k not in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor")
    }
    legacy.update(
        compress_ratios=[0, 4, 128, 4, 0],
        num_hash_layers=2,
        qk_rope_head_dim=8,
        rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256},
    )
    ours = V4Config.from_dict({"model_type": "deepseek_v4", **legacy})
    theirs = V4Config.from_dict(DeepseekV4Config(**legacy).to_dict())
    assert ours == theirs
    assert ours.layer_types == (SLIDING, CSA, HCA, CSA) and ours.mlp_layer_types[1:3] == (HASH_MOE, TOPK_MOE)
    assert ours.compress_rope.kind == "yarn" and ours.compress_attention_factor == 1.0


def _fp8_weight(tensors):
    tensors["model.layers.0.attn.wq_a.weight"] = tensors["model.layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)
    return tensors


def _block_scale(tensors):
    tensors["model.layers.0.attn.wq_a.scale"] = torch.ones(1, 1)
    return tensors


def _scale_inv(tensors):
    tensors["model.layers.0.attn.wq_a.weight_scale_inv"] = torch.ones(1, 1)
    return tensors


def _quantization_config(raw):
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


@pytest.mark.parametrize(
    "edit_tensors,edit_config",
    [(_fp8_weight, None), (_block_scale, None), (_scale_inv, None), (None, _quantization_config)],
    ids=["float8 weight", "block scale", "scale_inv", "quantization_config"],
)
def test_quantized_checkpoints_are_refused(tiny_v4, tmp_path, edit_tensors, edit_config):
    path = _rewrite(tiny_v4, tmp_path / "fp8", edit_tensors, edit_config)
    with pytest.raises(CheckpointError, match="dequantize the checkpoint to bf16 first"):
        load_deepseek_v4(path)


def _drop_position_bias(tensors):
    del tensors["model.layers.1.attn.compressor.ape"]
    return tensors


def _wrong_shape(tensors):
    tensors["model.layers.0.attn.wq_a.weight"] = torch.zeros(5, 64)
    return tensors


@pytest.mark.parametrize(
    "edit,named",
    [
        (_drop_position_bias, "model.layers.1.self_attn.compressor.position_bias"),
        (_wrong_shape, "model.layers.0.self_attn.q_a_proj.weight"),
    ],
    ids=["missing", "wrong shape"],
)
def test_incomplete_checkpoints_name_the_weight(tiny_v4, tmp_path, edit, named):
    path = _rewrite(tiny_v4, tmp_path / "broken", edit)
    with pytest.raises(CheckpointError, match=named):
        load_deepseek_v4(path)


def test_bfloat16_keeps_the_float32_parts(tiny_v4):
    """bf16 weights, but norms, hyper-connections, sinks, position biases and the router bias in float32, as
    transformers keeps them; the output stays close to float32's."""
    model = load_deepseek_v4(tiny_v4, dtype="bfloat16")
    dtypes = {name: t.dtype for name, t in model.state_dict().items()}
    assert dtypes["model.layers.1.self_attn.q_b_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.2.mlp.experts.gate_up_proj"] == torch.bfloat16
    for name in (
        "model.layers.1.self_attn.sinks",
        "model.layers.1.self_attn.compressor.position_bias",
        "model.layers.1.attn_hc.fn",
        "model.hc_head.hc_fn",
        "model.layers.1.self_attn.q_a_norm.weight",
        "model.layers.2.mlp.gate.e_score_correction_bias",
        "model.norm.weight",
    ):
        assert dtypes[name] == torch.float32, name
    ids = _tokens(batch=1)
    drift = (model(ids).log_softmax(-1) - load_deepseek_v4(tiny_v4)(ids).log_softmax(-1)).abs()
    assert drift.mean().item() < 0.1


# -- position-independent reuse (docs/deepseek-v4.md) ---------------------------------------------------------


def test_prefill_from_rows_is_the_full_forward(tiny_v4):
    """Computing every position through `prefill` (per-token rows, entries pooled from them) is the forward
    that matches transformers, and fills every layer's rows."""
    model = load_deepseek_v4(tiny_v4)
    ids = _tokens(1)[0]
    rows = model.new_rows(SEQ)
    got = model.prefill(ids, torch.arange(SEQ), rows)
    assert torch.equal(got, model.forward(ids))
    assert all(r.abs().sum(-1).gt(0).all() for r in rows)


@pytest.mark.parametrize("kind", [HCA, CSA, SLIDING])
def test_reuse_at_another_position_is_exact_on_one_layer(tmp_path, kind):
    """On one layer a token's rows depend on the token alone, so reusing them at another position, with the
    compressed entries pooled at the new alignment, equals full prefill: for a shift that is a multiple of
    both rates (16) and for one that is not (5). Keys rotated at their stale positions (naive) do not."""
    path = make_tiny_v4_checkpoint(
        tmp_path / kind, seed=2, num_hidden_layers=1, layer_types=[kind], mlp_layer_types=[TOPK_MOE]
    )
    model = load_deepseek_v4(path)
    for a, b in ((3, 19), (3, 8), (20, 4)):
        assert shifted_reuse_error(model, a, b, seed=a * 100 + b) < 1e-4, (kind, a, b)
        assert shifted_reuse_error(model, a, b, naive=True, seed=a * 100 + b) > 1e-2, (kind, a, b)
