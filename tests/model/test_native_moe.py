"""The routed experts of a few tokens through the native kernel (model/native/moe.c, `MoE._native`,
`native_ops.moe_experts`): the expert loop's output over random routings, both stacked layouts, sizes
with and without the vector kernels' multiples; where it does not run it is None; a bad expert id is an
error, not a wild read; the engine's tokens are the same with and without it."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from irminsul import LLM
from irminsul.model import layers, native
from irminsul.model.config import ModelConfig
from irminsul.model.layers import MoE
from irminsul.model.tiny import make_tiny_checkpoint, tiny_config

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="the native kernels need a C compiler")


def _moe(hidden, inner, experts, k, layouts, seed) -> MoE:
    cfg = ModelConfig.from_dict(tiny_config("v2", hidden_size=hidden, moe_intermediate_size=inner,
                                            n_routed_experts=experts, num_experts_per_tok=k))
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2)
    moe.layouts = layouts
    moe.stacked()
    return moe


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 64), experts=st.integers(2, 9), k=st.integers(1, 3), size=st.sampled_from([(64, 32), (48, 40), (37, 13)]),
       layouts=st.sampled_from([("in", "in"), ("out", "in"), ("in", "out"), ("out", "out")]), seed=st.integers(0, 2**16))
def test_the_kernel_equals_the_expert_loop(n, experts, k, size, layouts, seed):
    k = min(k, experts)
    moe = _moe(*size, experts, k, layouts, seed)
    x = torch.randn(n, size[0], generator=torch.Generator().manual_seed(seed))
    weights, ids = moe.gate(x)
    want = layers.expert_loop(x, weights, ids, lambda e, xs: moe.experts[e](xs))
    got = moe._native(x, weights, ids)
    assert got is not None
    assert (got - want).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1e-6)


def test_where_it_does_not_run_and_a_bad_expert_id(monkeypatch):
    moe = _moe(64, 32, 4, 2, ("in", "in"), 0)
    x = torch.randn(5, 64)
    weights, ids = moe.gate(x)
    assert moe._native(torch.randn(MoE.NATIVE_TOKENS + 1, 64), *moe.gate(torch.randn(MoE.NATIVE_TOKENS + 1, 64))) is None
    assert moe._native(x.bfloat16(), weights, ids) is None
    monkeypatch.setenv("IRMINSUL_NATIVE_MOE", "0")
    assert moe._native(x, weights, ids) is None
    monkeypatch.delenv("IRMINSUL_NATIVE_MOE")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert moe._native(x, weights, ids) is None
    finally:
        torch.set_num_threads(threads)
    bad = ids.clone()
    bad[2, 1] = 4
    with pytest.raises(ValueError, match="expert id"):
        moe._native(x, weights, bad)
    bad[2, 1] = -1
    with pytest.raises(ValueError, match="expert id"):
        moe._native(x, weights, bad)


def test_the_engine_decodes_the_same_tokens(tmp_path, monkeypatch):
    ck = make_tiny_checkpoint(tmp_path / "v3", variant="v3")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in (5, 17, 40, 9, 22)]
    got = {}
    calls = []
    real = layers.native_ops._moe_experts
    monkeypatch.setattr(layers.native_ops, "_moe_experts", lambda *a: calls.append(1) or real(*a))
    for flag in ("0", "1"):
        monkeypatch.setenv("IRMINSUL_NATIVE_MOE", flag)
        llm = LLM(ck, reuse="off", compile_decode=False)
        got[flag] = [o.token_ids for o in llm.generate(prompts, max_tokens=12, ignore_eos=True)]
    assert calls and got["0"] == got["1"]
