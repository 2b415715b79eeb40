"""bfloat16 products of many rows widened to float32 (`layers.widened`): the same sums as F.linear's,
rounded once, and taken from the row count kernel_choice measured it to win at."""

import pytest
import torch
import torch.nn.functional as F

from irminsul.model import kernel_choice, layers, widen
from irminsul.model.kernel_choice import Choice, KernelChoices
from irminsul.model.layers import Linear, packed
from irminsul.model.widen import widened


def _bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The gap between x and the next bfloat16 up, elementwise (one rounding step)."""
    return torch.finfo(torch.bfloat16).eps * x.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)


@pytest.mark.parametrize("slice_bytes", [widen.WIDEN_SLICE_BYTES, 4 * 64 * 7])  # whole, and slices of 7 rows
@pytest.mark.parametrize("layout", ["out", "in"])
def test_widened_rounds_the_float32_sums_once(slice_bytes, layout, monkeypatch):
    monkeypatch.setattr(widen, "WIDEN_SLICE_BYTES", slice_bytes)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(50, 64, generator=g) / 8).bfloat16()
    w = w if layout == "out" else w.t().contiguous().t()  # (an input-major weight's [out, in] view)
    x = torch.randn(2, 20, 64, generator=g).bfloat16()
    bias = torch.randn(50, generator=g).bfloat16()
    got = widened(x, w, bias)
    assert got.shape == (2, 20, 50) and got.dtype == torch.bfloat16
    want = F.linear(x.double(), w.double(), bias.double())
    # one rounding of a float32 sum: within one bf16 step of the exact value (float32's own error is
    # far below it), as F.linear's own bf16 product is
    assert ((got.double() - want).abs() <= _bf16_step(want)).all()
    assert ((F.linear(x, w, bias).double() - want).abs() <= _bf16_step(want)).all()


def test_a_broken_widening_is_caught():
    """The check above fails for a product that rounds twice (its float32 sums rounded per slice of
    inputs: what a widening that converted x after a partial product would do)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 512, generator=g).bfloat16()
    x = torch.randn(30, 512, generator=g).bfloat16()
    twice = sum(
        F.linear(x[:, i : i + 64].float(), w[:, i : i + 64].float()).bfloat16().float() for i in range(0, 512, 64)
    )
    want = F.linear(x.double(), w.double())
    assert not ((twice.double() - want).abs() <= _bf16_step(want)).all()


def _times(widen_32: float, widen_256: float, dense: float = 1.0) -> dict:
    return {
        "1": {"out": dense, "in": dense},
        "8": {"out": dense, "in": dense},
        "32": {"out": dense, "in": dense, "widen": widen_32},
        "256": {"out": dense, "in": dense, "widen": widen_256},
    }


def test_the_widened_rows_are_where_it_won_at_every_larger_count():
    assert kernel_choice._widen_rows(_times(0.5, 0.5), "out") == 32
    assert kernel_choice._widen_rows(_times(2.0, 0.5), "out") == 256
    assert kernel_choice._widen_rows(_times(0.5, 2.0), "out") == 0  # (not from 32 on: 256 loses)
    assert kernel_choice._widen_rows(_times(0.95, 0.95), "out") == 0  # within WIDEN_GAIN
    assert kernel_choice._widen_rows({"32": {"out": 1.0, "in": 1.0}}, "out") == 0  # never measured (float32)
    beaten = _times(0.5, 0.5)
    beaten["32"]["dnn"] = 0.3  # a kept oneDNN copy for 32 rows is faster there
    assert kernel_choice._widen_rows(beaten, "out", (32,)) == 256


def test_choose_records_it_and_a_linear_takes_it_from_those_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setattr(kernel_choice, "_memory", {})
    monkeypatch.setattr(kernel_choice, "measure", lambda *a: _times(0.5, 0.5))
    product = kernel_choice.Product(48, 64, torch.bfloat16, 1, 1.0, "out")
    choices = kernel_choice.choose([product], model_bytes=10**6, kernels="measured", progress=False)
    assert choices.choices[product.key] == Choice("out", widen=32)
    lin = Linear(64, 48, bias=False).bfloat16()
    lin.pack_dnn(choices)
    assert lin.widen_rows == 32
    calls = []
    real = layers.widened
    monkeypatch.setattr(layers, "widened", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(40, 64).bfloat16()
    assert torch.equal(lin(x), real(x, lin.weight))
    lin(x[:10])
    assert calls == [torch.Size([40, 64])]  # (10 rows: the dense product)


def test_packed_takes_it_too():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 48, generator=g).bfloat16()  # [in, out]
    x = torch.randn(33, 64, generator=g).bfloat16()
    assert torch.equal(packed(x, w, None, widen_rows=32), widened(x, w.t()))
    assert torch.equal(packed(x[:31], w, None, widen_rows=32), x[:31] @ w)
    assert KernelChoices.every("in", widen=32).choice(48, 64, torch.bfloat16).widen == 32


def test_from_eight_rows_where_it_wins_there_and_gemv_keeps_its_rows():
    t = _times(0.5, 0.5)
    t["8"]["widen"] = 0.5
    assert kernel_choice._widen_rows(t, "out") == 8
    lin = Linear(64, 48, bias=False).bfloat16()
    lin.gemv_rows, lin.widen_rows = 8, 8
    x = torch.randn(8, 64).bfloat16()
    from irminsul.model import gemv

    if gemv.available(dtype=torch.bfloat16):  # (eight rows: gemv's, not widened)
        assert torch.equal(lin(x), gemv.product(x, lin.weight))
    x9 = torch.randn(9, 64).bfloat16()
    assert torch.equal(lin(x9), widened(x9, lin.weight))


def test_the_absorbed_products_widen_from_their_rows():
    from irminsul.model.attention.base import absorb_output, absorb_query

    g = torch.Generator().manual_seed(9)
    q = torch.randn(12, 4, 16, generator=g).bfloat16()  # [n, H, nope]
    w_uk = torch.randn(4, 16, 32, generator=g).bfloat16()  # [H, nope, r]
    want = torch.einsum("nhd,hdr->nhr", q.double(), w_uk.double())
    got = absorb_query(q, w_uk, widen_rows=8)
    assert got.dtype == torch.bfloat16 and ((got.double() - want).abs() <= _bf16_step(want)).all()
    o = torch.randn(12, 4, 32, generator=g).bfloat16()  # [n, H, r]
    w_uv = torch.randn(4, 8, 32, generator=g).bfloat16()  # [H, v, r]
    want = torch.einsum("nhr,hvr->nhv", o.double(), w_uv.double())
    got = absorb_output(o, w_uv, widen_rows=8)
    assert ((got.double() - want).abs() <= _bf16_step(want)).all()
    assert torch.equal(absorb_output(o[:7], w_uv, widen_rows=8), absorb_output(o[:7], w_uv))  # (below: bmm's)


def test_a_bf16_model_packed_to_widen_keeps_its_logits(tiny_dir, tmp_path, monkeypatch):
    from irminsul.model.loader import load_model
    from irminsul.model.mla import MLAttention

    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    plain = load_model(tiny_dir, dtype="bfloat16", pack=False)
    model = load_model(tiny_dir, dtype="bfloat16", pack=False).pack(kernels=KernelChoices.every("out", widen=8))
    attn = next(m for m in model.modules() if isinstance(m, MLAttention))
    assert attn.absorbed_widen == (8, 8)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    got = []
    for m in (model, plain):
        seq = m.new_rows(64)
        got.append(m.logits(m.prefill(seq, ids, list(range(40)))).float())
    assert (got[0] - got[1]).abs().max().item() < 0.1 * got[1].abs().max().item()


def test_a_shape_timed_only_for_its_kernel_takes_no_copy_budget(tmp_path, monkeypatch):
    """The absorbed products have no weight of their own: a oneDNN copy that would pay for them is not
    offered, so it cannot take the budget a held weight of another shape needs."""
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setattr(kernel_choice, "_memory", {})

    def times(*a):
        t = _times(2.0, 2.0)
        for r in ("8", "32", "256"):
            t[r]["dnn"] = 0.1  # a copy pays at every block
        return t

    monkeypatch.setattr(kernel_choice, "measure", times)
    held = kernel_choice.Product(48, 64, torch.bfloat16, 1, 1.0, "out")
    timed = kernel_choice.Product(64, 16, torch.bfloat16, 1, 1.0, "out", held=False)  # (smaller: offered first)
    got = kernel_choice.choose([timed, held], model_bytes=48 * 64 * 2, kernels="measured", budget=1.0, progress=False)
    assert got.choices[timed.key].blocks == () and got.choices[held.key].blocks != ()
    merged = kernel_choice._merged([timed, kernel_choice.Product(64, 16, torch.bfloat16, 1, 1.0, "out")])
    assert merged[0].held and (merged[0].count, merged[0].uses) == (1, 1.0)
