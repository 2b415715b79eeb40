"""The GQA hit path used for wall time is a real position-independent reuse: exact at one layer."""

import numpy as np
import pytest
import torch

from irminsul.research.eval.timing import MovedSpan, gqa_cached_span, gqa_hit_logits, llama_rotary


def _llama(layers):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        initializer_range=0.3,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("layers, exact", [(1, True), (2, False)])
def test_gqa_hit_equals_full_prefill_only_without_context_drift(layers, exact):
    model = _llama(layers)
    req = MovedSpan.random(np.random.default_rng(0), 300, header=20, shared=120, tail=10)
    assert req.delta != 0
    hit = gqa_hit_logits(model, llama_rotary(model.config), req, gqa_cached_span(model, req))
    with torch.no_grad():
        full = model(input_ids=torch.tensor([req.prompt])).logits[0, -1]
    err = (hit - full).abs().max().item()
    assert (err < 1e-4) if exact else (err > 1e-4), err


def test_gqa_hit_without_rotation_is_wrong():
    model = _llama(1)
    req = MovedSpan.random(np.random.default_rng(1), 300, header=20, shared=120, tail=10)
    rot = llama_rotary(model.config)
    rot.rotate = lambda k, delta: k  # stale K, as a naive GQA cache would serve it
    hit = gqa_hit_logits(model, rot, req, gqa_cached_span(model, req))
    with torch.no_grad():
        full = model(input_ids=torch.tensor([req.prompt])).logits[0, -1]
    assert (hit - full).abs().max().item() > 1e-3
