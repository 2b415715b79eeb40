"""Each native kernel computes the same bits on one thread and on two (model/native: the threads
share independent outputs, never one sum), at shapes large enough for a call to take a team; and the
library is built with the OpenMP runtime torch loaded, one copy of it in the process."""

import pytest
import torch

from irminsul.model import elementwise, gemv, native, native_ops

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native kernels need a C compiler")


def _at(threads: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _same_at_one_and_two(fn):
    one, two = _at(1, fn), _at(2, fn)
    assert one is not None and two is not None
    assert torch.equal(one, two)


def test_one_openmp_runtime_is_loaded():
    if not native._torch_uses_openmp():
        pytest.skip("torch's parallel backend is not OpenMP: the kernels run on one thread")
    assert native.library().irm_openmp() == 1
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomp) == 1, gomp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(67, 2048, generator=g).to(dtype), torch.randn(2048, generator=g).to(dtype)
    _same_at_one_and_two(lambda: elementwise.rms_norm(x, w, 1e-6))


def test_silu_mul():
    gu = 3 * torch.randn(67, 2 * 1408, generator=torch.Generator().manual_seed(1))
    _same_at_one_and_two(lambda: elementwise.silu_mul(gu))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_products(dtype, rows, monkeypatch):
    monkeypatch.delenv("IRMINSUL_GEMV", raising=False)
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(3001, 517, generator=g).to(dtype), torch.randn(rows, 517, generator=g).to(dtype)
    bias = torch.randn(3001, generator=g).to(dtype)
    _same_at_one_and_two(lambda: gemv.product(x, w, bias))
    xh, wh = torch.randn(rows, 16, 128, generator=g).to(dtype), torch.randn(16, 512, 128, generator=g).to(dtype)
    _same_at_one_and_two(lambda: gemv.heads(xh, wh))


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, h, r, rope", [(1, 16, 512, 64), (3, 8, 128, 16), (2, 6, 80, 32)])
def test_decode_attention(pool_dtype, b, h, r, rope):
    """One sequence (its heads split among the threads) and several (the sequences split)."""
    g = torch.Generator().manual_seed(h)
    t = 300
    pool = torch.randn(b * t + 5, r + rope, generator=g).to(pool_dtype)
    slots = torch.randperm(b * t + 4, generator=g)[: b * t].view(b, t) + 1
    slots[:, ::7] = 0  # (holes)
    q = torch.randn(b, h, r + rope, generator=g)
    cos, sin = torch.rand(t, rope // 2, generator=g), torch.rand(t, rope // 2, generator=g)
    own = torch.randn(b, r + rope, generator=g)
    _same_at_one_and_two(lambda: native_ops.call_mla_decode(q, pool, slots, cos, sin, own, r, True, 0.1))


@pytest.mark.parametrize("b, m, h", [(1, 200, 1), (2, 130, 4)])
def test_prefill_attention(b, m, h):
    """One head of one sequence (its superblocks split among the threads) and several heads."""
    g = torch.Generator().manual_seed(m)
    nope, rope, vd = 64, 32, 48
    q_nope, q_pe = torch.randn(b, m, h, nope, generator=g), torch.randn(b, m, h, rope, generator=g)
    k_nope, v = torch.randn(b, m, h, nope, generator=g), torch.randn(b, m, h, vd, generator=g)
    k_r = torch.randn(b, m, rope, generator=g)
    slots = torch.arange(1, b * m + 1).view(b, m)
    slots[:, 5::11] = 0
    pos = torch.arange(m).repeat(b, 1)
    qlen = torch.tensor([m - 3 * i for i in range(b)])
    _same_at_one_and_two(lambda: native_ops.call_prefill_attention(q_nope, q_pe, k_nope, k_r, v, slots, pos, qlen, 0.1))


def _experts(e, hidden, inner, dtype, in_major):
    g = torch.Generator().manual_seed(hidden)
    gate_up = torch.randn(e, hidden, 2 * inner, generator=g).to(dtype) / hidden**0.5
    down = torch.randn(e, inner, hidden, generator=g).to(dtype) / inner**0.5
    if not in_major:  # out-major: stride 1 along the input
        gate_up = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
        down = down.transpose(1, 2).contiguous().transpose(1, 2)
    return gate_up, down


@pytest.mark.parametrize("in_major", [True, False])
@pytest.mark.parametrize("n, hidden, inner", [(1, 512, 256), (37, 256, 96), (20, 200, 52)])
def test_experts(in_major, n, hidden, inner):
    gate_up, down = _experts(6, hidden, inner, torch.float32, in_major)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, hidden, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(n)])
    weights = torch.rand(n, 3, generator=g)
    _same_at_one_and_two(lambda: native_ops._moe_experts(x, weights, ids, gate_up, down))


def test_bf16_experts():
    gate_up, down = _experts(6, 512, 192, torch.bfloat16, False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, 512, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(33)])
    weights = torch.rand(33, 3, generator=g)
    _same_at_one_and_two(lambda: native_ops._moe_experts_bf16(x, weights, ids, gate_up, down))
