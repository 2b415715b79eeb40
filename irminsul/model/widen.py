"""Products of many rows of a bfloat16 weight, computed in float32: `widened`.

On a CPU without bf16 instructions torch's bf16 product of many rows runs far below its float32 one;
converting x and the weight as they are used costs one pass over the weight per call, and for enough
rows it is faster (`kernel_choice` measures from how many, per shape: `Choice.widen`).
"""

from __future__ import annotations

import torch

# `widened` converts a weight to float32 in slices of at most this many bytes of float32 (the whole
# weight at once would hold a float32 copy of an LM head)
WIDEN_SLICE_BYTES = 16 * 2**20


def widened(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] times weight [out, in] (any strides, bfloat16) plus bias, in float32: x and slices
    of the weight's output rows converted as they are used, the sums rounded once to x's dtype as
    F.linear rounds them."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    out = weight.shape[0]
    step = max(1, WIDEN_SLICE_BYTES // (4 * weight.shape[1]))
    if step >= out:
        y = torch.mm(x2, weight.float().t())
    else:
        y = x2.new_empty(x2.shape[0], out)
        for at in range(0, out, step):
            y[:, at : at + step] = torch.mm(x2, weight[at : at + step].float().t())
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], out)
