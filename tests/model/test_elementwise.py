"""RMSNorm and silu(gate) * up through the native kernels (model/elementwise.py,
model/native/elementwise.c), on each build this CPU executes (tests/model/native_variants.py): float64
references over shapes with vector tails, strided rows and special values; where they do not run they return None (other dtypes, switched off) and the
layers compute with torch; the layers and the engine give the same results with and without them."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from irminsul import LLM
from irminsul.model import elementwise, native
from irminsul.model.layers import MLP, RMSNorm
from irminsul.model.settings import Settings
from irminsul.model.tiny import make_tiny_checkpoint
from tests.model.native_variants import variant  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="the native kernels need a C compiler")


def _rms_reference(x, w, eps):
    x = x.double()
    return w.double() * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _silu_mul_reference(gu):
    g, u = gu.double().chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(0, 40),
    d=st.integers(1, 300),
    pad=st.integers(0, 20),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_equals_the_reference(variant, rows, d, pad, scale, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, d + pad, generator=g) * scale
    x = base[:, :d]  # rows pad floats apart when pad > 0 (a view into a wider tensor)
    w = torch.randn(d, generator=g)
    got = elementwise.rms_norm(x, w, 1e-6)
    assert got is not None and got.shape == x.shape and got.dtype == torch.float32
    want = _rms_reference(x, w, 1e-6)
    assert (got.double() - want).abs().max().item() <= 1e-6 * max(want.abs().max().item(), 1e-30) if rows else True


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(0, 30),
    inner=st.integers(1, 130),
    pad=st.integers(0, 9),
    scale=st.sampled_from([0.1, 3.0, 40.0]),
    seed=st.integers(0, 2**16),
)
def test_silu_mul_equals_the_reference(variant, rows, inner, pad, scale, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, 2 * inner + pad, generator=g) * scale
    gu = base[:, : 2 * inner]
    got = elementwise.silu_mul(gu)
    assert got is not None and got.shape == (rows, inner)
    want = _silu_mul_reference(gu)
    err = (got.double() - want).abs()
    assert (err <= 1e-6 * want.abs() + 1e-30 * scale).all() if rows else True


def test_special_values_behave_as_torch(variant):
    """NaN stays NaN, +inf gives inf, -inf gives NaN (torch's x / (1 + e^-x) is -inf / inf), large
    negatives give ~0; a NaN in a row makes that row of RMSNorm NaN and no other. In the vector body
    (8 or 16 at a time) and in the tail."""
    specials = torch.tensor(
        [
            float("nan"),
            float("inf"),
            float("-inf"),
            -200.0,
            -88.0,
            -87.0,
            -86.0,
            0.0,
            -0.0,
            1e-30,
            20.0,
            -20.0,
            88.0,
            100.0,
            3.0,
            -3.0,
        ]
    )
    for g in (specials.repeat(2), specials[:7]):  # (32: two vectors; 7: the tail only)
        gu = torch.cat([g, torch.full_like(g, 2.0)])[None]
        got, want = elementwise.silu_mul(gu)[0], 2.0 * F.silu(g)
        assert torch.equal(got.isnan(), want.isnan())
        finite = ~want.isnan()
        assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=1e-30)
    x = torch.randn(3, 40)
    x[1, 17] = float("nan")
    got = elementwise.rms_norm(x, torch.ones(40), 1e-6)
    assert got[1].isnan().all() and not got[[0, 2]].isnan().any()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 12),
    d=st.sampled_from([1, 7, 64, 300, 2048]),
    scale=st.sampled_from([1e-3, 1.0, 40.0]),
    seed=st.integers(0, 2**16),
)
# a case where the sums' order moves the normalised x's rounding and the product's adds a second step
# (more than one bf16 step apart: the bound below is two)
@example(rows=4, d=2048, scale=1e-3, seed=50)
def test_bf16_rms_norm_rounds_as_torchs_ops(variant, monkeypatch, rows, d, scale, seed):
    """A bf16 model's RMSNorm: what layers.RMSNorm's torch ops give in bf16 (the normalised x rounded,
    then its product with the weight), but for the float32 sum's order: all but a few elements equal,
    none more than two bf16 steps apart (a sum in another order can move the normalised x's rounding by
    one step, and the product's rounding then adds up to one more)."""
    from irminsul.model.layers import RMSNorm

    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(rows, d, generator=g)).bfloat16()
    norm = RMSNorm(d, 1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g))
    got = elementwise.rms_norm(x, norm.weight, 1e-6)
    norm.settings = Settings(native_elementwise=False)  # (torch's ops)
    want = norm(x)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == want.shape
    step = want.float().abs() * 2.0**-7 + 1e-30
    assert ((got.float() - want.float()).abs() <= 2 * step).all()
    assert (got == want).float().mean().item() >= 0.97


def test_where_they_do_not_run_they_return_none(monkeypatch):
    x, w = torch.randn(4, 64), torch.randn(64)
    assert elementwise.rms_norm(x.bfloat16(), w, 1e-6) is None  # (bf16 x, float32 weight: torch's ops)
    assert elementwise.rms_norm(x, w.bfloat16(), 1e-6) is None
    assert elementwise.rms_norm(x.t().contiguous().t(), w, 1e-6) is None  # (elements not contiguous)
    assert elementwise.silu_mul(torch.randn(4, 7)) is None  # (an odd width is no [gate | up])


def test_switched_off_the_layers_do_not_call_them(monkeypatch):
    """IRMINSUL_NATIVE_ELEMENTWISE=0 when a layer is built (or its model loaded): the layer keeps
    torch's ops, whatever the environment says later."""
    for name in ("rms_norm", "silu_mul"):
        monkeypatch.setattr(elementwise, name, lambda *a, _n=name: pytest.fail(f"{_n} ran"))
    monkeypatch.setenv("IRMINSUL_NATIVE_ELEMENTWISE", "0")
    norm, mlp = RMSNorm(64, 1e-6), MLP(64, 32)
    mlp.pack()
    monkeypatch.delenv("IRMINSUL_NATIVE_ELEMENTWISE")
    x = torch.randn(4, 64)
    with torch.no_grad():
        norm(x), mlp(x)


def test_the_layers_compute_the_same_with_and_without(monkeypatch):
    torch.manual_seed(0)
    norm, mlp = RMSNorm(48, 1e-6), MLP(48, 80)
    with torch.no_grad():
        norm.weight.normal_()
    mlp.pack()
    x = torch.randn(3, 5, 48)  # (three dims: viewed as rows)
    calls = []
    for name in ("rms_norm", "silu_mul"):
        real = getattr(elementwise, name)
        monkeypatch.setattr(elementwise, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a))
    with torch.no_grad():
        a, b = norm(x), mlp(x)
        norm.settings = mlp.settings = Settings(native_elementwise=False)
        c, d = norm(x), mlp(x)
    assert {"rms_norm", "silu_mul"} <= set(calls)
    assert (a - c).abs().max().item() < 1e-5 and (b - d).abs().max().item() < 1e-5


def test_the_engines_greedy_tokens_are_the_same_with_and_without(tmp_path, monkeypatch):
    path = make_tiny_checkpoint(tmp_path / "m")
    prompts = [[5 + i, 9, 40 + 3 * i, 7, 100 - i] * 6 for i in range(3)]
    got = []
    for flag in ("1", "0"):
        monkeypatch.setenv("IRMINSUL_NATIVE_ELEMENTWISE", flag)
        llm = LLM(path, compile_decode=False)
        got.append([o.token_ids for o in llm.generate(prompts, max_tokens=12, ignore_eos=True)])
    assert got[0] == got[1]
