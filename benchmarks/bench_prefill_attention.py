"""Expanded prefill attention, one layer's call, one thread, float32: the native kernel
(model/native/prefill_attention.c, `CPUAttention.NATIVE_PREFILL`) against SDPA's flash kernel as the
engine called it before (q, k and v assembled head-major and padded to one width), on the same inputs,
measured in the same run. Shapes: the bundled model's batch prefill (21 prompts of 100 tokens, the
first chunk of bench_engine's batch), its 1,500-token prompt, and V2-Lite / Moonlight widths (16 heads,
q·k 192, v 128) at 1,500 tokens. Prints the machine, each time (median of --repeats) and the ratio
(> 1: the kernel is faster), and the largest difference between the two outputs.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefill_attention.py [--repeats 9]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from irminsul.machine import describe, median_of
from irminsul.model import native, native_ops

SHAPES = {  # name: (prompts, tokens, heads, nope, rope, v)
    "bundled 21 x 100": (21, 100, 8, 32, 16, 48),
    "bundled 1 x 1500": (1, 1500, 8, 32, 16, 48),
    "V2-Lite 1 x 1500": (1, 1500, 16, 128, 64, 128),
}


def median_ms(fn, repeats: int) -> float:
    return median_of(fn, repeats) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("machine:", describe())
    lib = native.library()
    if lib is None or not lib.irm_vectorised():
        print("the native prefill attention is not built with its vector tiles here: the engine keeps SDPA")
        return
    g = torch.Generator().manual_seed(0)
    print(f"{'shape':<18} {'SDPA ms':>9} {'native ms':>10} {'ratio':>7} {'max diff':>9}")
    for name, (b, n, h, nope, rope, vd) in SHAPES.items():
        kv = torch.randn(b, n, h, nope + vd, generator=g)  # the kv_b product, as the engine holds it
        k_nope, v = kv[..., :nope], kv[..., nope:]
        k_r = torch.randn(b, n, rope, generator=g)
        q = torch.randn(b, n, h, nope + rope, generator=g)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        slots = torch.arange(1, b * n + 1).view(b, n)
        pos = torch.arange(n).repeat(b, 1)
        qlen = torch.full((b,), n)
        scale = (nope + rope) ** -0.5
        width = max(nope + rope, vd)

        def sdpa():  # what CPUAttention._expanded assembled for SDPA
            qq = q.new_empty(b, h, n, width)
            qq[..., : nope + rope] = q.transpose(1, 2)
            qq[..., nope + rope :] = 0
            kk = q.new_empty(b, h, n, width)
            kk[..., :nope] = k_nope.transpose(1, 2)
            kk[..., nope : nope + rope] = k_r[:, None]
            kk[..., nope + rope :] = 0
            vv = F.pad(v, (0, width - vd)).transpose(1, 2).contiguous()
            return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale).transpose(1, 2)[..., :vd]

        def ours():
            return native_ops.call_prefill_attention(q_nope, q_pe, k_nope, k_r, v, slots, pos, qlen, scale)

        diff = (sdpa() - ours()).abs().max().item()
        # interleaved: a neighbour's burst on this shared machine hits both alike
        a, c = [], []
        for _ in range(3):
            a.append(median_ms(sdpa, args.repeats))
            c.append(median_ms(ours, args.repeats))
        a_ms, c_ms = sorted(a)[1], sorted(c)[1]
        print(f"{name:<18} {a_ms:>9.2f} {c_ms:>10.2f} {a_ms / c_ms:>6.2f}x {diff:>9.1e}")


if __name__ == "__main__":
    main()
