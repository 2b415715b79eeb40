"""Products of one row that stream their weight at the memory's speed on a CPU: x [1, in] times W [out, in].

A decode step of one sequence is a chain of one-row products, each bound by reading its weight
once. torch's own kernels can read a bf16 weight well below the memory's speed for one row
(`python benchmarks/bench_gemv_layout.py` shows it per machine). This module runs a plain C loop over each weight row,
fp32 products and sums: `irminsul/model/native/gemv.c`, built for the CPU it runs on at first use
(model/native), called through ctypes on the tensors' memory. It reads W row by row, so it needs
W's rows contiguous (out-major, nn.Linear's layout, any row stride: pack_linears' views), float32
or bfloat16; x, bias and the result in float32 or bfloat16 (the result in x's dtype, rounded once
from the fp32 sum, as F.linear rounds). It computes up to MAX_ROWS rows per call, reading each
weight row once for all of them; the model uses it for one row.

Whether it runs for a shape is `kernel_choice`'s measurement on the machine ("gemv", a candidate
for one-row products of out-major weights), not a rule: on some CPUs it is faster than F.linear on
some of a realistic model's shapes and slower on others, and is taken for those only. It is a
candidate only where the kernel built (`available`; a C compiler) and IRMINSUL_GEMV is not 0 (the
test suite sets 0, and tests/model/test_gemv.py turns it back on). It shares the output rows among
torch's threads; kernel_choice times it against F.linear at torch's thread count.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from irminsul.model import native
from irminsul.model.settings import settings

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # what the kernel reads: the flag it takes per tensor
MAX_ROWS = 8  # (the C source's IRM_MAX_ROWS)


def available(device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel can run here: a CPU, the native library built, IRMINSUL_GEMV not 0, and
    (when given) a weight dtype it reads. The first call that finds the library sets its prefetch
    distance (`prefetch`)."""
    if torch.device(device).type != "cpu" or not settings.gemv:
        return False
    if dtype is not None and dtype not in DTYPES:
        return False
    lib = native.library()
    if lib is None:
        return False
    prefetch(lib)
    return True


# How far ahead the one-row loop may ask for a weight's bytes (0: it does not): on some CPUs the
# prefetches raise the read rate, on others they lower it, so each is timed here.
PREFETCH_BYTES = (0, 2048)


@functools.cache
def prefetch(lib) -> int:
    """Times one-row products of a bfloat16 weight larger than the caches (64 MiB: each pass reads it
    from memory, as a decode step reads its weights) with each of PREFETCH_BYTES, interleaved, at
    torch's thread count; sets the fastest in `lib` (`irm_gemv_set_prefetch`, once per library and
    process; ~0.1 s) and returns it."""
    w = torch.ones(16384, 2048, dtype=torch.bfloat16)
    x = torch.ones(1, 2048, dtype=torch.bfloat16)
    times: dict[int, list[float]] = {b: [] for b in PREFETCH_BYTES}
    for _ in range(5):
        for b in PREFETCH_BYTES:
            lib.irm_gemv_set_prefetch(b)
            t = time.perf_counter()
            product(x, w)
            times[b].append(time.perf_counter() - t)
    best = min(PREFETCH_BYTES, key=lambda b: sorted(times[b])[len(times[b]) // 2])
    lib.irm_gemv_set_prefetch(best)
    return best


def rows(x: torch.Tensor) -> int:
    """The rows of x [..., in] (0 for an empty batch or an empty row)."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] holding 1 to MAX_ROWS rows, w [out, in] with contiguous rows (w.stride(1) == 1)
    -> [..., out] in x's dtype. Inside a graph being compiled, or for what the kernel does not read
    (another dtype, more rows, a strided row), it is F.linear."""
    n = rows(x)
    if (
        torch.compiler.is_compiling()
        or not 1 <= n <= MAX_ROWS
        or w.stride(1) != 1
        or x.device.type != "cpu"
        or x.dtype not in DTYPES
        or w.dtype not in DTYPES
        or (bias is not None and bias.dtype not in DTYPES)
    ):
        return F.linear(x, w, bias)
    lib = native.library()
    if lib is None:
        return F.linear(x, w, bias)
    x2 = x.reshape(n, x.shape[-1])
    if x2.stride(-1) != 1 or x2.stride(0) < x2.shape[1]:
        x2 = x2.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    out = w.shape[0]
    y = torch.empty(n, out, dtype=x.dtype)
    rc = lib.irm_linear(
        x2.data_ptr(),
        DTYPES[x.dtype],
        n,
        x2.stride(0),
        w.data_ptr(),
        DTYPES[w.dtype],
        out,
        w.shape[1],
        w.stride(0),
        None if bias is None else bias.data_ptr(),
        0 if bias is None else DTYPES[bias.dtype],
        y.data_ptr(),
        DTYPES[y.dtype],
        out,
        torch.get_num_threads(),
    )
    if rc != 0:  # (no memory for x's fp32 copy)
        return F.linear(x, w, bias)
    return y.view(*x.shape[:-1], out)


def heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [n, H, in] (1 to MAX_ROWS rows, each head's in contiguous) times each head's w [H, out, in]
    (its rows contiguous) -> [n, H, out] in x's dtype: attention's absorbed per-head products
    (`attention.base.absorb_query` / `absorb_output`, asked where the backend's settings have gemv
    on). None where the kernel does not run (see `product`; then the caller's bmm)."""
    n, h, inner = x.shape
    if (
        torch.compiler.is_compiling()
        or not 1 <= n <= MAX_ROWS
        or x.device.type != "cpu"
        or w.shape[0] != h
        or w.shape[2] != inner
        or x.stride(2) != 1
        or w.stride(2) != 1
        or x.dtype not in DTYPES
        or w.dtype not in DTYPES
    ):
        return None
    lib = native.library()
    if lib is None:
        return None
    out = w.shape[1]
    y = torch.empty(n, h, out, dtype=x.dtype)
    rc = lib.irm_heads_linear(
        x.data_ptr(),
        DTYPES[x.dtype],
        n,
        x.stride(0),
        x.stride(1),
        h,
        w.data_ptr(),
        DTYPES[w.dtype],
        w.stride(0),
        out,
        inner,
        w.stride(1),
        y.data_ptr(),
        DTYPES[y.dtype],
        y.stride(0),
        y.stride(1),
        torch.get_num_threads(),
    )
    return y if rc == 0 else None
