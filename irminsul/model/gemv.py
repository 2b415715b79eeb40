"""One-row products that stream their weight at the memory's speed on a CPU: x [1, in] times W [out, in].

A decode step of one sequence is a chain of one-row products, each bound by reading its weight
once. torch's own kernels read a bf16 weight well below the memory's speed for one row: on an AMD
EPYC with AVX512-BF16 (one thread) `F.linear` read the 129,280 x 2,048 LM head at ~10 GB/s and `x @ W`
at ~6, where a plain sum streams 25. The same product written as a multiply and a sum over each
weight row, `(x * W).sum(-1)` in float32, is one reduction loop that inductor (torch.compile's CPU
backend) vectorises for the CPU it runs on: it read the same head at ~20 GB/s, and the model's
other products at 12-19 GB/s against F.linear's 6-10 (`benchmarks/bench_gemv_layout.py` prints
both). It reads W row by row, so it needs W's rows contiguous (out-major, nn.Linear's layout), and
only one row of x pays: with two, inductor's loop reads W once per row.

Whether it runs for a shape is `kernel_choice`'s measurement on the machine ("gemv", a candidate
for one-row products of out-major weights), not a rule; it is a candidate only where a C++
compiler is found and compiled kernels are allowed (`available`: IRMINSUL_COMPILE_DECODE=0 or
IRMINSUL_GEMV=0 turn it off). One compiled kernel per dtype (dynamic shapes), built on first use:
~1 s warm, longer the first time torch.compile runs in a process. A call costs ~45 us more than
F.linear's (the compiled function's guards), which the measurement includes: small weights keep
F.linear.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


def _rows_dot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [1, in], w [out, in] -> [1, out] in x's dtype; products and sums in float32."""
    return (x.float() * w.float()).sum(-1).to(x.dtype)[None]


@functools.cache
def _compiled():
    return torch.compile(_rows_dot, dynamic=True)


@functools.cache
def _compiler_found() -> bool:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
        return True
    except Exception:  # inductor's InvalidCxxCompiler, or anything else that says "no compiler"
        return False


def available(device: torch.device | str = "cpu") -> bool:
    """Whether the kernel can run here: a CPU, a C++ compiler for inductor, and compiled kernels not
    turned off (IRMINSUL_COMPILE_DECODE=0, as the test suite sets, or IRMINSUL_GEMV=0)."""
    if torch.device(device).type != "cpu":
        return False
    if os.environ.get("IRMINSUL_GEMV") == "0" or os.environ.get("IRMINSUL_COMPILE_DECODE") == "0":
        return False
    return _compiler_found()


def product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] holding one row, w [out, in] with contiguous rows (w.stride(1) == 1) -> [..., out].
    Inside a graph being compiled it is F.linear (the graph's own backend lowers it)."""
    if torch.compiler.is_compiling():
        return F.linear(x, w, bias)
    # (plain tensors: a Parameter, or one that requires grad, would be guarded on and compiled again)
    y = _compiled()(x.detach().reshape(1, x.shape[-1]), w.detach())
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], w.shape[0])
