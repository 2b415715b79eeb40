"""The routed experts of a few tokens through the native kernel (model/native/moe.c, `MoE._native`,
`native_ops.moe_experts`): the expert loop's output over random routings, both stacked layouts, sizes
with and without the vector kernels' multiples, float32 and bfloat16, on each build this CPU executes
(tests/model/native_variants.py); where it does not run it is None; a bad expert id is an
error, not a wild read; the engine's tokens are the same with and without it."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from irminsul import LLM
from irminsul.model import layers, native
from irminsul.model.config import ModelConfig
from irminsul.model.layers import MoE
from irminsul.model.settings import Settings
from irminsul.model.tiny import make_tiny_checkpoint, tiny_config
from tests.model.native_variants import variant  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="the native kernels need a C compiler")


def _moe(hidden, inner, experts, k, layouts, seed) -> MoE:
    cfg = ModelConfig.from_dict(
        tiny_config(
            "v2", hidden_size=hidden, moe_intermediate_size=inner, n_routed_experts=experts, num_experts_per_tok=k
        )
    )
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2)
    moe.layouts = layouts
    moe.stacked()
    return moe


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 64),
    experts=st.integers(2, 9),
    k=st.integers(1, 3),
    size=st.sampled_from([(64, 32), (48, 40), (37, 13)]),
    layouts=st.sampled_from([("in", "in"), ("out", "in"), ("in", "out"), ("out", "out")]),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_equals_the_expert_loop(variant, n, experts, k, size, layouts, seed):
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
    assert (
        moe._native(torch.randn(MoE.NATIVE_TOKENS + 1, 64), *moe.gate(torch.randn(MoE.NATIVE_TOKENS + 1, 64))) is None
    )
    assert moe._native(x.bfloat16(), weights, ids) is None
    moe.settings = Settings(native_moe=False)
    assert moe._native(x, weights, ids) is None
    moe.settings = Settings()
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


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 64),
    experts=st.integers(2, 9),
    k=st.integers(1, 3),
    size=st.sampled_from([(64, 32), (96, 80), (37, 13)]),
    seed=st.integers(0, 2**16),
)
def test_the_bf16_kernel_equals_the_expert_loop_in_float64(variant, n, experts, k, size, seed):
    """A bfloat16 model's experts (out-major stacks, sizes with and without 32-element tails) against
    the same bf16 weights and tokens in float64: within what bf16's rounding of the result and of
    silu * up allows, no worse than torch's own bf16 expert loop by more than that."""
    import copy

    k = min(k, experts)
    moe = _moe(*size, experts, k, ("out", "out"), seed).to(torch.bfloat16)
    moe._stacked = None
    moe.stacked()
    wide = copy.deepcopy(moe).double()
    x = torch.randn(n, size[0], generator=torch.Generator().manual_seed(seed)).bfloat16()
    weights, ids = moe.gate(x)
    want = layers.expert_loop(x.double(), weights.double(), ids, lambda e, xs: wide.experts[e](xs))
    got = moe._native(x, weights, ids)
    assert got is not None and got.dtype == torch.bfloat16
    torch_bf16 = layers.expert_loop(x, weights, ids, lambda e, xs: moe.experts[e](xs))
    scale = max(want.abs().max().item(), 1e-6)
    err = (got.double() - want).abs().max().item() / scale
    assert err <= 2e-2 and err <= 1.5 * (torch_bf16.double() - want).abs().max().item() / scale + 8e-3


def test_the_bf16_kernel_reads_only_out_major_stacks_and_checks_ids():
    moe = _moe(64, 32, 4, 2, ("in", "out"), 0).to(torch.bfloat16)
    moe._stacked = None
    x = torch.randn(5, 64).bfloat16()
    weights, ids = moe.gate(x)
    assert moe._native(x, weights, ids) is None  # (input-major gate|up: torch's products)
    moe.layouts, moe._stacked = ("out", "out"), None
    assert moe._native(x, weights, ids) is not None
    bad = ids.clone()
    bad[2, 1] = 4
    with pytest.raises(ValueError, match="expert id"):
        moe._native(x, weights, bad)


def test_a_bf16_engine_decodes_the_same_tokens_as_torchs_experts(tmp_path, monkeypatch):
    """The tiny V3 in bf16, a batch decoded with the kernel and without: the kernel ran, and the
    greedy tokens agree (bf16 rounds differently in the two; a near-tie may flip a late token, so
    most of each sequence, and the first tokens of every one, must match)."""
    ck = make_tiny_checkpoint(tmp_path / "v3", variant="v3")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in (5, 17, 40, 9)]
    got, calls = {}, []
    real = layers.native_ops._moe_experts_bf16
    monkeypatch.setattr(layers.native_ops, "_moe_experts_bf16", lambda *a: calls.append(1) or real(*a))
    for flag in ("0", "1"):
        monkeypatch.setenv("IRMINSUL_NATIVE_MOE", flag)
        llm = LLM(ck, reuse="off", compile_decode=False, dtype="bfloat16")
        for layer in llm.model.model.layers:  # (out-major stacks, which the kernel reads, whatever was chosen,
            if isinstance(layer.mlp, MoE):  # and every token count, whatever this CPU's measurement took)
                layer.mlp.layouts, layer.mlp._stacked = ("out", "out"), None
                layer.mlp.native_counts, layer.mlp.native_tokens = None, MoE.NATIVE_TOKENS
        got[flag] = [o.token_ids for o in llm.generate(prompts, max_tokens=12, ignore_eos=True)]
    assert calls
    for a, b in zip(got["0"], got["1"]):
        assert a[:3] == b[:3] and sum(x == y for x, y in zip(a, b)) >= 9


def test_the_kernel_takes_up_to_the_layers_measured_bound_in_either_dtype():
    """`native_tokens` (measured when a model is packed: tests/model/test_kernel_choice.py) bounds the
    tokens the kernel takes, float32 and bfloat16 alike: no rule by CPU flags."""
    dtypes = [torch.float32] + ([torch.bfloat16] if layers.native_ops.moe_bf16_available() else [])
    for dtype in dtypes:
        moe = _moe(64, 32, 4, 2, ("out", "out"), 1).to(dtype)
        moe._stacked = None
        moe.native_tokens = 5
        for n, runs in ((5, True), (6, False)):
            x = torch.randn(n, 64).to(dtype)
            assert (moe._native(x, *moe.gate(x)) is not None) == runs, (dtype, n)
