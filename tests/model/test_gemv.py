"""The native product kernel (model/gemv.py, model/native/gemv.c) and where it runs: it computes
F.linear's product for one to eight rows at any shape, stride and dtype it reads (on each build this CPU
executes: tests/model/native_variants.py), kernel_choice takes it only where it measured faster for an
out-major weight, and a model packed with it computes the same logits through every path that
has one row (attention's input product, the LM head, the dense MLP, each routed expert)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from irminsul.model import gemv, kernel_choice, native
from irminsul.model.kernel_choice import Choice, KernelChoices, Product
from irminsul.model.layers import MLP, MoE
from irminsul.model.loader import load_model
from tests.model.native_variants import variant  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="the native kernel needs a C compiler")
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}  # relative to the product's largest value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_f, in_f", [(1, 1), (7, 3), (96, 80), (1030, 136), (129, 2049)])
def test_one_row_computes_f_linear(variant, dtype, out_f, in_f):
    g = torch.Generator().manual_seed(out_f * 7 + in_f)
    w = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype)
    for x in (torch.randn(1, in_f, generator=g).to(dtype), torch.randn(1, 1, in_f, generator=g).to(dtype)):
        want = F.linear(x.double(), w.double())
        for b in (None, bias):
            ref = want if b is None else want + b.double()
            got = gemv.product(x, w, b)
            assert got.shape == ref.shape and got.dtype == dtype
            scale = ref.abs().max().item()
            assert (got.double() - ref).abs().max().item() <= TOL[dtype] * scale, (x.shape, b is None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, gemv.MAX_ROWS + 1),
    out_f=st.integers(1, 70),
    in_f=st.integers(1, 300),
    dtypes=st.tuples(*[st.sampled_from([torch.float32, torch.bfloat16])] * 3),
    with_bias=st.booleans(),
    x_pad=st.integers(0, 20),
    seed=st.integers(0, 2**16),
)
@example(rows=1, out_f=1, in_f=268, dtypes=(torch.float32,) * 3, with_bias=True, x_pad=1, seed=5702)  # (cancels)
def test_rows_of_any_shape_stride_and_dtype_compute_f_linear(
    variant, rows, out_f, in_f, dtypes, with_bias, x_pad, seed
):
    """1 to MAX_ROWS rows in one call (each weight row read once for all), x's rows a slice of a wider
    tensor, x, w and bias each float32 or bfloat16: the result is F.linear's in x's dtype (a row count
    the kernel does not take is F.linear itself, which takes one dtype)."""
    x_dtype, w_dtype, b_dtype = dtypes if rows <= gemv.MAX_ROWS else dtypes[:1] * 3  # (F.linear takes one dtype)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(w_dtype)
    x = torch.randn(rows, in_f + x_pad, generator=g).to(x_dtype)[:, x_pad:]
    bias = torch.randn(out_f, generator=g).to(b_dtype) if with_bias else None
    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    got = gemv.product(x, w, bias)
    assert got.shape == ref.shape and got.dtype == x_dtype
    tol = TOL[torch.bfloat16 if torch.bfloat16 in (x_dtype, w_dtype) else torch.float32]
    # relative to the magnitude of what is summed (|x| . |w| + |bias|), not of the sum: a bias that
    # cancels the product leaves a tiny result whose float32 rounding error is the terms' size's
    size = F.linear(x.double().abs(), w.double().abs(), None if bias is None else bias.double().abs())
    assert (got.double() - ref).abs().max().item() <= tol * max(size.max().item(), 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefetching_changes_no_result_and_the_measured_distance_is_a_candidate(variant, dtype):
    """The one-row loop's prefetch distance (timed on the machine by `gemv.prefetch`) only asks for
    bytes early: every distance gives the same bits, and the measured one is a candidate."""
    lib = native.library()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 4100, generator=g).to(dtype)
    x = torch.randn(1, 4100, generator=g).to(dtype)
    try:
        results = []
        for b in (0, 64, 2048):
            lib.irm_gemv_set_prefetch(b)
            results.append(gemv.product(x, w))
        assert all(torch.equal(results[0], r) for r in results[1:])
        gemv.prefetch.cache_clear()
        assert gemv.prefetch(lib) in gemv.PREFETCH_BYTES
    finally:
        gemv.prefetch.cache_clear()
        lib.irm_gemv_set_prefetch(0)
    assert torch.allclose(results[0].double(), F.linear(x.double(), w.double()), rtol=TOL[dtype], atol=TOL[dtype] * 40)


def test_a_bf16_result_is_rounded_to_nearest_as_f_linear_rounds():
    """The fp32 sum is rounded once to bf16, to nearest: F.linear's bf16 result (of the same fp32 sum)
    almost everywhere; where the two sums differ in their last bits the roundings can differ by one
    bf16 step, no more (truncating instead differs at about half the outputs)."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(4096, 256, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    got = gemv.product(x, w).float()
    want = F.linear(x.float(), w.float()).to(torch.bfloat16).float()
    step = want.abs() * 2.0**-7
    assert ((got - want).abs() <= step).all()
    assert (got == want).float().mean().item() > 0.97


def test_special_values_propagate(variant):
    """A NaN or infinity in x reaches the outputs it touches (the bf16 rounding keeps a NaN a NaN)."""
    w = torch.ones(3, 40, dtype=torch.bfloat16)
    x = torch.zeros(2, 40, dtype=torch.bfloat16)
    x[0, 7], x[1, 39] = float("nan"), float("inf")
    got = gemv.product(x, w)
    assert got[0].isnan().all() and got[1].isinf().all() and (got[1] > 0).all()


def test_rows_of_a_wider_storage_are_read_where_they_lie():
    """A weight whose rows are a slice of a wider matrix (stride(0) > in), as pack_linears' views are."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(50, 300, generator=g)
    w = wide[5:45, 100:228]
    assert w.stride() == (300, 1)
    x = torch.randn(1, 128, generator=g)
    assert torch.allclose(gemv.product(x, w), F.linear(x, w), atol=1e-5)


def test_available_follows_the_switches(monkeypatch):
    monkeypatch.delenv("IRMINSUL_GEMV", raising=False)
    assert gemv.available() and gemv.available(dtype=torch.bfloat16)
    assert not gemv.available("meta")  # (a CPU only)
    assert not gemv.available(dtype=torch.float16)  # (a dtype the kernel does not read)
    monkeypatch.setenv("IRMINSUL_GEMV", "0")  # (the test suite's setting)
    assert not gemv.available()


def _times(one_out, one_gemv, one_in=None):
    """Times where every row count but one favours out-major a little; one row as given."""
    t = {str(r): {"out": 1.0 * r, "in": 1.05 * r} for r in kernel_choice.ROWS}
    t["1"] = {"out": one_out, "in": one_in if one_in is not None else 1.05 * one_out, "gemv": one_gemv}
    return t


def test_the_choice_takes_gemv_only_where_it_pays_on_an_out_major_weight(tmp_path, monkeypatch):
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setenv("IRMINSUL_GEMV", "1")
    monkeypatch.setattr(kernel_choice, "_memory", {})
    faster, tie, beaten = (
        Product(300, 200, torch.float32, 1, 1.0),
        Product(301, 200, torch.float32, 1, 1.0),
        Product(302, 200, torch.float32, 1, 1.0),
    )
    # input-major wins elsewhere by far; gemv makes out-major's one row the best: out-major wins overall
    flips = Product(303, 200, torch.float32, 1, 1.0)
    forced = Product(304, 200, torch.float32, 1, 1.0, "out")
    fake = {300: _times(1.0, 0.5), 301: _times(1.0, 0.97), 302: _times(1.0, 2.0), 304: _times(1.0, 0.5)}
    fake[303] = {str(r): {"out": 1.0 * r, "in": 0.9 * r} for r in kernel_choice.ROWS}
    fake[303]["1"] = {"out": 1.0, "in": 0.9, "gemv": 0.3}
    seen = []

    def measure(out, inp, dtype, streamed, with_dnn, with_gemv=False):
        seen.append(with_gemv)
        return fake[out]

    monkeypatch.setattr(kernel_choice, "measure", measure)
    got = kernel_choice.choose(
        [faster, tie, beaten, flips, forced], model_bytes=10**9, kernels="measured", progress=False
    ).choices
    assert all(seen)  # (the candidate is timed where it is available)
    assert got[faster.key] == Choice("out", (), 1)
    assert got[tie.key] == Choice("out") and got[beaten.key] == Choice("out")  # within GEMV_GAIN, or slower
    assert got[flips.key] == Choice("out", (), 1)
    assert got[forced.key] == Choice("out", (), 1)
    # with the kernel unavailable its times are not asked for (another cache entry), nor chosen
    monkeypatch.setenv("IRMINSUL_GEMV", "0")
    monkeypatch.setattr(kernel_choice, "_memory", {})
    seen.clear()
    fake[303] = {str(r): {"out": 1.0 * r, "in": 0.9 * r} for r in kernel_choice.ROWS}
    got = kernel_choice.choose([flips], model_bytes=10**9, kernels="measured", progress=False).choices
    assert seen == [False] and got[flips.key] == Choice("in")


def test_the_choice_takes_gemv_for_eight_rows_only_where_it_beats_dense_and_onednn_there(tmp_path, monkeypatch):
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setenv("IRMINSUL_GEMV", "1")
    monkeypatch.setattr(kernel_choice, "_memory", {})
    both, no_dnn, dnn_wins, not_one = (Product(o, 200, torch.float32, 1, 1.0) for o in (310, 311, 312, 313))
    fake = {o: _times(1.0, 0.5) for o in (310, 311, 312, 313)}
    fake[310]["8"] = {"out": 8.0, "in": 8.4, "dnn": 6.0, "gemv": 3.0}
    fake[311]["8"] = {"out": 8.0, "in": 8.4, "gemv": 3.0}  # (no oneDNN here: bf16 without bf16 instructions)
    fake[312]["8"] = {"out": 8.0, "in": 8.4, "dnn": 2.9, "gemv": 3.0}
    fake[313]["1"]["gemv"] = 2.0  # slower for one row: not taken for eight either
    fake[313]["8"] = {"out": 8.0, "in": 8.4, "gemv": 3.0}
    monkeypatch.setattr(kernel_choice, "measure", lambda out, *a, **k: fake[out])
    got = kernel_choice.choose(
        [both, no_dnn, dnn_wins, not_one], model_bytes=10**9, kernels="measured", progress=False
    ).choices
    assert got[both.key].gemv == 8 and got[no_dnn.key].gemv == 8
    assert got[dnn_wins.key].gemv == 1 and got[not_one.key].gemv == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_packed_with_gemv_for_eight_rows_computes_the_same_logits(tiny_dir, monkeypatch, dtype):
    """Products of 2 to 8 rows (a short prefill, a decode step of a few sequences) through the kernel
    (forced): the logits of the model packed without it; 9 rows are not taken."""
    monkeypatch.setenv("IRMINSUL_GEMV", "1")
    plain = load_model(tiny_dir, pack=False, dtype=dtype).pack(kernels=KernelChoices.every("out"))
    model = load_model(tiny_dir, pack=False, dtype=dtype).pack(kernels=KernelChoices.every("out", gemv=8))
    assert set(_one_row_flags(model)) == {8}
    calls = []
    real = gemv.product
    monkeypatch.setattr(gemv, "product", lambda *a: calls.append(a[0].numel() // a[0].shape[-1]) or real(*a))
    for n in (2, 5, 8, 9):
        ids = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        calls.clear()
        got = [m.logits(m.prefill(m.new_rows(64), ids, list(range(n)))) for m in (model, plain)]
        scale = got[1].abs().max().item()
        assert (got[0] - got[1]).abs().max().item() <= (1e-4 if dtype == torch.float32 else 3e-2) * scale
        # (every product of the n rows; the routed experts' share of them too, fewer rows each)
        assert max(calls) == n if n <= 8 else max(calls, default=0) <= 8


def _one_row_flags(model) -> list[int]:
    flags = [model.lm_head.gemv_rows]
    for layer in model.model.layers:
        flags.append(layer.self_attn.in_proj_gemv_rows)
        flags.append(layer.self_attn.o_proj.gemv_rows)
        mlp = layer.mlp
        experts = list(mlp.experts) if isinstance(mlp, MoE) else [mlp]
        for e in experts + ([mlp.shared_experts] if isinstance(mlp, MoE) and mlp.shared_experts else []):
            assert isinstance(e, MLP)
            flags += [e.gate_up_gemv_rows, e.down_proj.gemv_rows]
    return flags


def test_a_model_packed_with_gemv_computes_the_same_logits(tiny_dir, monkeypatch):
    """Every one-row product through the kernel (forced), a prefill and decode steps of one sequence:
    the logits of the model packed without it."""
    monkeypatch.setenv("IRMINSUL_GEMV", "1")
    plain = load_model(tiny_dir, pack=False).pack(kernels=KernelChoices.every("out"))
    model = load_model(tiny_dir, pack=False).pack(kernels=KernelChoices.every("out", gemv=True))
    assert all(_one_row_flags(model)) and not any(_one_row_flags(plain))
    calls = []
    real = gemv.product
    monkeypatch.setattr(gemv, "product", lambda *a: calls.append(a[1].shape) or real(*a))
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(8)).tolist()
    rows = {m: m.new_rows(64) for m in (model, plain)}
    got = {m: [m.logits(m.prefill(rows[m], ids, list(range(20))))] for m in (model, plain)}
    for step, tok in enumerate((5, 77, 123)):
        for m in (model, plain):
            got[m].append(m.logits(m.prefill(rows[m], [tok], [20 + step])))
    for a, b in zip(got[model], got[plain]):
        assert (a - b).abs().max().item() < 1e-4
    empty = torch.zeros(0, model.config.hidden_size)  # (an empty batch is no one-row product)
    assert model.lm_head(empty).shape == (0, model.config.vocab_size)
    # (the prefill's last-token logits and three decode steps: the LM head each time, and the layers' products)
    assert len(calls) > 4 * len(model.model.layers) and (model.lm_head.weight.shape in calls)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 9),
    heads=st.integers(1, 5),
    out_f=st.integers(1, 70),
    in_f=st.integers(1, 140),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_per_head_products_compute_bmm(monkeypatch, n, heads, out_f, in_f, dtype, seed):
    """`gemv.heads` (attention's absorbed W_UK / W_UV products): each head's rows times its own weight,
    against float64; x a strided view of a wider tensor, as the attention hands it; None past MAX_ROWS."""
    monkeypatch.setenv("IRMINSUL_GEMV", "1")  # (the suite turns the kernel off: tests/conftest.py)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(heads, out_f, in_f, generator=g) / in_f**0.5).to(dtype)
    x = torch.randn(n, heads, in_f + 3, generator=g).to(dtype)[..., 1 : in_f + 1]
    got = gemv.heads(x, w)
    if n > gemv.MAX_ROWS:
        assert got is None
        return
    want = torch.einsum("nhi,hoi->nho", x.double(), w.double())
    assert got is not None and got.dtype == dtype and got.shape == (n, heads, out_f)
    assert (got.double() - want).abs().max().item() <= TOL[dtype] * max(want.abs().max().item(), 1e-6)


def test_absorbed_products_of_a_bf16_decode_take_the_per_head_kernel(monkeypatch):
    from irminsul.model.attention.base import absorb_output, absorb_query

    monkeypatch.setenv("IRMINSUL_GEMV", "1")
    calls = []
    real = gemv.heads
    monkeypatch.setattr(gemv, "heads", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    w_uk = (
        torch.randn(4, 32, 64).bfloat16().transpose(1, 2).contiguous().transpose(1, 2)
    )  # [H, nope, r], stored [H, r, nope]
    w_uv = torch.randn(4, 16, 64).bfloat16()
    q = torch.randn(3, 4, 32).bfloat16()
    o = torch.randn(3, 4, 64).bfloat16()
    want_q = torch.bmm(q.transpose(0, 1).double(), w_uk.double()).transpose(0, 1)
    want_o = torch.bmm(o.transpose(0, 1).double(), w_uv.transpose(1, 2).double()).transpose(0, 1)
    assert (absorb_query(q, w_uk, per_head=True).double() - want_q).abs().max() <= 1e-2 * want_q.abs().max()
    assert (absorb_output(o, w_uv, per_head=True).double() - want_o).abs().max() <= 1e-2 * want_o.abs().max()
    assert calls == [3, 3]
    absorb_query(q.float(), w_uk.float(), per_head=True)  # (fp32: bmm)
    absorb_query(torch.randn(12, 4, 32).bfloat16(), w_uk, per_head=True)  # (12 rows: bmm)
    assert calls == [3, 3, 12]
    absorb_query(q, w_uk), absorb_output(o, w_uv)  # (a backend whose settings have gemv off)
    assert calls == [3, 3, 12]
