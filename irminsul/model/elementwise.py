"""RMSNorm and SwiGLU's silu(gate) * up in one pass each, on a CPU: `irminsul/model/native/elementwise.c`.

In eager torch, RMSNorm is five operations over its rows (square, mean, + eps, rsqrt, two products)
and silu(g) * u two, each a full pass and a dispatch (a visible share of a prefill in torch.profiler;
benchmarks/bench_native_kernels.py times both forms). RMSNorm
rounds as torch's ops do but for the order of one float32 sum; silu uses the kernels' own exp and
reciprocal (within ~1e-7 relative of torch's, its special values kept: tests/model/test_elementwise.py).

They run where the native library built, for float32 tensors (RMSNorm also bfloat16: nine norms a
decode token of the realistic bf16 model, each several dispatches as torch's ops) on a CPU, their
rows shared among torch's threads, outside graphs being compiled (inductor fuses these operations
itself). Each function returns None where it does not run; the caller computes with torch. The layers
call them only where their settings have them on (`layers.RMSNorm`, `layers.MLP`: native_elementwise,
IRMINSUL_NATIVE_ELEMENTWISE=0 turns them off when a model is loaded).
"""

from __future__ import annotations

import torch

from irminsul.model import native


def _runs(x: torch.Tensor, w: torch.Tensor | None = None, dtypes=(torch.float32,)) -> bool:
    # (is_compiling first: inside a graph being traced nothing after it may run, or the graph breaks)
    return (
        not torch.compiler.is_compiling()
        and x.dtype in dtypes
        and (w is None or w.dtype is x.dtype)
        and x.device.type == "cpu"
        and (w is None or w.device.type == "cpu")
        and native.library() is not None
    )


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [n, d] rows with contiguous elements (a view where it can be, without copying)."""
    if x.dim() == 0 or (x.stride(-1) != 1 and x.shape[-1] > 1 and x.numel()):  # (a size-1 or empty dim's stride is any)
        return None
    x2 = x if x.dim() == 2 else (x.reshape(-1, x.shape[-1]) if x.is_contiguous() else None)
    return x2 if x2 is not None and x2.dim() == 2 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2, -1) + eps), or None where the kernel does not run. bfloat16 x and
    weight (a bf16 model) are rounded as torch rounds them (`layers.RMSNorm`'s own ops): the
    normalised x to bf16, then its product with the weight."""
    if (
        not _runs(x, weight, (torch.float32, torch.bfloat16))
        or weight.dim() != 1
        or weight.stride(0) != 1
        or x.shape[-1] != weight.shape[0]
    ):
        return None
    x2 = _rows(x)
    if x2 is None:
        return None
    out = torch.empty(x2.shape, dtype=x.dtype)
    kernel = native.library().irm_rms_norm if x.dtype is torch.float32 else native.library().irm_rms_norm_bf16
    kernel(
        x2.data_ptr(),
        x2.shape[0],
        x2.shape[1],
        x2.stride(0),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out if x2 is x else out.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(g) * u of gate_up [..., 2 * inner] = [g | u], or None where the kernel does not run."""
    if not _runs(gate_up) or gate_up.shape[-1] % 2:
        return None
    gu = _rows(gate_up)
    if gu is None:
        return None
    inner = gu.shape[1] // 2
    out = torch.empty(gu.shape[0], inner, dtype=torch.float32)
    native.library().irm_silu_mul(
        gu.data_ptr(), gu.shape[0], inner, gu.stride(0), out.data_ptr(), inner, torch.get_num_threads()
    )
    return out if gu is gate_up else out.view(*gate_up.shape[:-1], inner)
