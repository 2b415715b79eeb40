"""Our absorbed MLA engine against transformers' own DeepSeek modelling code (>= 5.15)."""

import pytest
import torch

from irminsul.model.loader import load_model
from irminsul.model.tiny import make_tiny_checkpoint

transformers = pytest.importorskip("transformers", minversion="5.15")

CASES = [
    ("v2", False, {}),
    ("v2", True, {}),
    ("v2", True, {"q_lora_rank": 24}),
    ("v2", False, {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}),
    ("v2", False, {"tie_word_embeddings": True, "first_k_dense_replace": 3}),
    ("v3", False, {}),
    ("v3", True, {"q_lora_rank": 24}),
    ("v3", True, {"rope_interleave": False}),
    ("v3", False, {"rope_interleave": False, "n_group": 1, "topk_group": 1, "norm_topk_prob": False}),
    # GLM-4.7-Flash (glm4_moe_lite): query LoRA, per-layer MLP kinds (here dense, MoE, dense)
    ("glm", False, {}),
    ("glm", True, {"mlp_layer_types": ["dense", "sparse", "dense"]}),
    ("glm", True, {"rope_interleave": False, "q_lora_rank": None}),
    # LongCat-Flash: blocks of two MLA sublayers (a cache row each), shortcut MoE with identity experts
    ("longcat", False, {}),
    ("longcat", True, {"zero_expert_num": 4, "moe_topk": 3}),
    # DeepSeek-V3.2: the DSA indexer keeps index_topk of the 96 keys per query (16, then 8)
    ("v32", False, {}),
    ("v32", True, {"index_topk": 8}),
]


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("variant,yarn,extra", CASES, ids=[f"{v}-yarn{y}-{sorted(e)}" for v, y, e in CASES])
def test_logprobs_match_transformers(tmp_path, variant, yarn, extra):
    path = make_tiny_checkpoint(tmp_path / "ckpt", variant, yarn, seed=3, **extra)
    ours, hf = load_model(path), _hf(path)
    ids = torch.randint(0, 300, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf(ids, use_cache=True)
    ref = out.logits[0].log_softmax(-1)
    seq = ours.new_rows()
    got = ours.logits(ours.prefill(seq, ids[0], torch.arange(96))).log_softmax(-1)
    assert (got - ref).abs().max().item() < 1e-4
    # The cached rows, with k_r encoded at their positions as attention reads them, are transformers'
    # latent cache: c_KV after the norm, k_r rotated, same layout.
    cfg, rows = ours.config, seq.rows(ours.rotary)
    r, latent = cfg.kv_lora_rank, cfg.latent_width
    for layer, cache_layer in enumerate(out.past_key_values.layers):
        c_kv, k_r = cache_layer.keys[0, 0], cache_layer.values[0, 0]
        assert torch.allclose(rows[layer, :96, :r], c_kv, atol=1e-5)
        assert torch.allclose(rows[layer, :96, r:latent], k_r, atol=1e-5)
        if cfg.index_head_dim:  # V3.2: the indexer's keys too (rotary part encoded, half-split)
            assert torch.allclose(rows[layer, :96, latent:], cache_layer.indexer_keys[0], atol=1e-5)


def test_v32_sparse_selection_changes_the_output(tmp_path):
    """The parity above is not vacuous for V3.2: keeping 16 of 96 keys per query changes the
    log-probs, so the indexer's top-k is what both implementations agree on."""
    ids = torch.randint(0, 300, (96,), generator=torch.Generator().manual_seed(0))
    out = []
    for topk in (16, 4096):
        m = load_model(make_tiny_checkpoint(tmp_path / str(topk), "v32", seed=3, index_topk=topk))
        out.append(m.logits(m.prefill(m.new_rows(), ids, torch.arange(96))).log_softmax(-1))
    assert (out[0] - out[1]).abs().max().item() > 1e-2


def test_parity_is_sensitive_to_the_yarn_softmax_scale(tmp_path, monkeypatch):
    """The comparison above can fail: dropping YaRN's mscale² (HF < 5.15's V2 bug) breaks it."""
    path = make_tiny_checkpoint(tmp_path / "ckpt", "v2", True, seed=3, std=0.3)
    ours, hf = load_model(path), _hf(path)
    ids = torch.randint(0, 300, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0].log_softmax(-1)
    cfg = ours.config
    monkeypatch.setattr(type(cfg), "softmax_scale", property(lambda self: self.qk_head_dim**-0.5))
    got = ours.logits(ours.prefill(ours.new_rows(), ids[0], torch.arange(64))).log_softmax(-1)
    assert (got - ref).abs().max().item() > 1e-3


def test_bundled_model_agrees_with_transformers():
    """The shipped MLA checkpoint loads in both implementations and they agree on real text."""
    from irminsul import bundled_model
    from irminsul.data import data_file
    from irminsul.model.tokenizer import Tokenizer

    path = bundled_model("mla")
    text = data_file("tau_bench", "retail_wiki.md").read_text()
    ids = torch.tensor(Tokenizer(path).encode(text)[:512])
    ours, hf = load_model(path), _hf(path)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].log_softmax(-1)
    got = ours.logits(ours.prefill(ours.new_rows(), ids, torch.arange(len(ids)))).log_softmax(-1)
    assert (got - ref).abs().max().item() < 1e-4


def test_bundled_gqa_twin_loads_in_llama():
    """The GQA twin is a standard Llama checkpoint with the MLA model's tokenizer."""
    from transformers import LlamaForCausalLM

    from irminsul import bundled_model

    twin = LlamaForCausalLM.from_pretrained(bundled_model("gqa"), dtype=torch.float32).eval()
    assert twin.config.num_key_value_heads < twin.config.num_attention_heads
    assert (bundled_model("gqa") / "tokenizer.json").read_bytes() == (
        bundled_model("mla") / "tokenizer.json"
    ).read_bytes()
    with torch.no_grad():
        logits = twin(torch.arange(1, 65)[None]).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == twin.config.vocab_size
