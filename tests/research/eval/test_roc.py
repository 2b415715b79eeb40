"""The ROC test's layout and its AUCs on a tiny MLA model and a tiny Llama."""

import numpy as np
import pytest

from irminsul.model.tiny import make_tiny_checkpoint
from irminsul.research.eval.roc import layout, positions_for, run_roc


def _sample(rng, k):
    return rng.integers(0, 250, k).tolist()


def test_positions_scale_to_the_context():
    assert positions_for(8192, 64) == (0, 512, 1024, 2048, 3584)
    pos = positions_for(2048, 64, head=1)
    assert pos[0] == 1 and pos[-1] + 64 <= 2048 and list(pos) == sorted(pos)


def test_layout_puts_every_block_at_every_position_after_different_text():
    positions = (0, 20, 45)
    blocks = [[1000 + 10 * b + i for i in range(8)] for b in range(5)]
    seen = {}
    for ids, placed in layout(5, positions, blocks, _sample, np.random.default_rng(0)):
        for b, i, start in placed:
            assert start == positions[i] and ids[start : start + 8] == blocks[b]
            seen.setdefault(b, set()).add(i)
    assert all(s == {0, 1, 2} for s in seen.values())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("roc")
    mla = make_tiny_checkpoint(root / "mla", num_hidden_layers=2, std=0.3, max_position_embeddings=512)
    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        initializer_range=0.3,
    )
    LlamaForCausalLM(cfg).save_pretrained(root / "gqa")
    return mla, root / "gqa"


def test_latent_is_position_invariant_at_layer0_and_gqa_key_is_not(models):
    mla, gqa = models
    res = run_roc(mla, _sample, gqa, n=8, block_tokens=16, tokens_per_block=8, progress=False)
    m, g = res.to_json()["mla"], res.to_json()["gqa"]
    assert set(m) >= {"c_kv", "k_r", "v"} and set(g) >= {"k", "v"}
    assert m["per_layer"]["c_kv"][0] > 0.95  # layer 0: c_KV is a function of the token alone
    assert m["per_layer"]["v"][0] > 0.95
    assert g["per_layer"]["k"][0] < m["per_layer"]["c_kv"][0]  # RoPE'd whole K moves with position
    assert all(0.0 <= a <= 1.0 for a in m["per_layer"]["k_r"])
