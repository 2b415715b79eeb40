"""Each native kernel (model/native) against torch's path for the same work, at 1 and 2 threads.

    python benchmarks/bench_native_kernels.py [--threads 1,2] [--repeats 7] [--only mla_decode,moe]
        [--variants native,x86-64]

Shapes: the bundled model's (irminsul/bundled/mla, float32: hidden 256, 8 heads, kv_lora 128 + rope
16, nope 32, v 48, 8 experts of 128, top 2) and a realistic bf16 model's (DeepSeek-V2-Lite /
Moonlight widths, bench_real_shapes.py: hidden 2048, 16 heads, kv_lora 512 + rope 64, nope 128, v
128, 64 experts of 1,408, top 6; prefill attention in float32, as the engine runs it). torch's path
is what the engine runs without the kernel: RMSNorm's and silu * up's ops, F.linear, the absorbed
decode attention's gather + two products + softmax, SDPA, the loop over the experts hit. Each time
is the best of --repeats medians of a few calls, the two paths interleaved (a neighbour's burst on a
shared machine hits both alike); ratio > 1: the kernel is faster. --variants: the builds timed
(model/native VARIANTS; each loaded side by side, selected through IRMINSUL_NATIVE_MARCH, which
`native.default_variant` reads again after each switch). Prints the machine and the builds.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from irminsul.machine import describe
from irminsul.model import elementwise, gemv, layers, native, native_ops
from irminsul.table import table

BUNDLED = dict(hidden=256, heads=8, r=128, rope=16, nope=32, v=48, experts=8, inner=128, k=2, dtype=torch.float32)
REAL = dict(hidden=2048, heads=16, r=512, rope=64, nope=128, v=128, experts=64, inner=1408, k=6, dtype=torch.bfloat16)


def _time(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def _on(variant: str, fn):
    os.environ["IRMINSUL_NATIVE_MARCH"] = variant
    native.default_variant.cache_clear()  # (read once per process otherwise)
    return fn()


def compare(torch_fn, native_fn, variants: list[str], repeats: int) -> list[float]:
    """[torch s, native s on each variant] per call: each the best of `repeats` rounds, all interleaved."""
    torch_fn()
    for v in variants:
        _on(v, native_fn)
    t0 = time.perf_counter()
    torch_fn()
    calls = max(1, min(50, int(0.02 / max(time.perf_counter() - t0, 1e-6))))
    times = [[] for _ in range(len(variants) + 1)]
    for _ in range(repeats):
        times[0].append(_time(torch_fn, calls))
        for i, v in enumerate(variants):
            times[i + 1].append(_on(v, lambda: _time(native_fn, calls)))
    return [min(t) for t in times]


def _rms_torch(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def cases(only: set[str] | None):
    """(kernel, shape, torch fn, native fn) for every case."""
    g = torch.Generator().manual_seed(0)
    out = []
    for name, m, rows in (("bundled", BUNDLED, (1, 32, 1500)), ("real bf16", REAL, (1, 8, 1500))):
        dt, hd = m["dtype"], m["hidden"]
        for n in rows:
            x, w = torch.randn(n, hd, generator=g).to(dt), torch.randn(hd, generator=g).to(dt)
            out.append(
                (
                    "rms_norm",
                    f"{name} {n} x {hd}",
                    lambda x=x, w=w: _rms_torch(x, w),
                    lambda x=x, w=w: elementwise.rms_norm(x, w, 1e-6),
                )
            )
            if dt == torch.float32:
                gu = torch.randn(n, 2 * m["inner"] * (6 if name == "bundled" else 1), generator=g)
                i = gu.shape[1] // 2
                out.append(
                    (
                        "silu_mul",
                        f"{name} {n} x {i}",
                        lambda gu=gu, i=i: F.silu(gu[:, :i]) * gu[:, i:],
                        lambda gu=gu: elementwise.silu_mul(gu),
                    )
                )
        for o, i in (
            (3 * m["heads"] * (m["nope"] + m["rope"]) // 2, hd),
            (hd, m["heads"] * m["v"]),
            (8192 if name == "bundled" else 129280, hd),
        ):
            w = (torch.randn(o, i, generator=g) / i**0.5).to(dt)
            for n in (1, 8):
                x = torch.randn(n, i, generator=g).to(dt)
                out.append(
                    (
                        "gemv",
                        f"{name} {n} x {o} x {i}",
                        lambda x=x, w=w: F.linear(x, w),
                        lambda x=x, w=w: gemv.product(x, w),
                    )
                )
        r, rope, h = m["r"], m["rope"], m["heads"]
        for b, t in ((1, 1500), (32 if name == "bundled" else 8, 200)):
            pool = torch.randn(b * t + 1, r + rope, generator=g).to(dt)
            slots = torch.arange(1, b * t + 1).view(b, t)
            q = torch.randn(b, h, r + rope, generator=g)
            cos, sin = torch.rand(t, rope // 2, generator=g), torch.rand(t, rope // 2, generator=g)

            def decode_torch(q=q, pool=pool, slots=slots, cos=cos, sin=sin, r=r):
                keys = pool[slots].float()  # [B, T, r + rope]
                kr = keys[..., r:].unflatten(-1, (-1, 2))
                a, c = kr[..., 0], kr[..., 1]
                rot = torch.stack([a * cos - c * sin, c * cos + a * sin], -1).flatten(-2)
                k = torch.cat([keys[..., :r], rot], -1)
                p = (torch.bmm(q, k.transpose(1, 2)) * 0.1).softmax(-1)
                return torch.bmm(p, keys[..., :r])

            out.append(
                (
                    "mla_decode",
                    f"{name} {b} x {t}",
                    decode_torch,
                    lambda q=q, pool=pool, slots=slots, cos=cos, sin=sin, r=r: native_ops.call_mla_decode(
                        q, pool, slots, cos, sin, None, r, True, 0.1
                    ),
                )
            )
        nope, vd = m["nope"], m["v"]
        for b, n in ((21, 100), (1, 1500)) if name == "bundled" else ((1, 1500),):
            kv = torch.randn(b, n, h, nope + vd, generator=g)
            k_nope, v = kv[..., :nope], kv[..., nope:]
            k_r = torch.randn(b, n, rope, generator=g)
            qq = torch.randn(b, n, h, nope + rope, generator=g)
            slots = torch.arange(1, b * n + 1).view(b, n)
            pos, qlen = torch.arange(n).repeat(b, 1), torch.full((b,), n)

            def sdpa(qq=qq, k_nope=k_nope, k_r=k_r, v=v, h=h, nope=nope, rope=rope, vd=vd):
                width = max(nope + rope, vd)
                q4 = F.pad(qq, (0, width - nope - rope)).transpose(1, 2)
                k4 = F.pad(
                    torch.cat([k_nope, k_r[:, :, None].expand(-1, -1, h, -1)], -1), (0, width - nope - rope)
                ).transpose(1, 2)
                v4 = F.pad(v, (0, width - vd)).transpose(1, 2)
                return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=0.1)

            out.append(
                (
                    "prefill_attention",
                    f"{name} {b} x {n}",
                    sdpa,
                    lambda qq=qq, k_nope=k_nope, k_r=k_r, v=v, slots=slots, pos=pos, qlen=qlen, nope=nope: (
                        native_ops.call_prefill_attention(
                            qq[..., :nope], qq[..., nope:], k_nope, k_r, v, slots, pos, qlen, 0.1
                        )
                    ),
                )
            )
        e, inner, k = m["experts"], m["inner"], m["k"]
        gate_up = (torch.randn(e, 2 * inner, hd, generator=g) / hd**0.5).to(dt).transpose(1, 2)  # out-major
        down = (torch.randn(e, hd, inner, generator=g) / inner**0.5).to(dt).transpose(1, 2)
        kernel = native_ops._moe_experts if dt == torch.float32 else native_ops._moe_experts_bf16
        if dt == torch.float32 or native_ops.moe_bf16_available():
            for n in (1, 8, 32):
                x = torch.randn(n, hd, generator=g).to(dt)
                ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
                wts = torch.rand(n, k, generator=g)

                def run(ex, xs, gate_up=gate_up, down=down, inner=inner):
                    gu = xs @ gate_up[ex]
                    return (F.silu(gu[:, :inner]) * gu[:, inner:]) @ down[ex]

                out.append(
                    (
                        "moe",
                        f"{name} {n} tokens",
                        lambda x=x, wts=wts, ids=ids, run=run: layers.expert_loop(x, wts, ids, run),
                        lambda x=x, wts=wts, ids=ids, kernel=kernel, gate_up=gate_up, down=down: kernel(
                            x, wts, ids, gate_up, down
                        ),
                    )
                )
    return [c for c in out if only is None or c[0] in only]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", default=None, help="kernels, comma-separated")
    ap.add_argument("--variants", default="native", help="builds, comma-separated (model/native VARIANTS)")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    print("machine:", describe())
    for v in variants:
        lib = native.library(v)
        if lib is None:
            print(f"no {v} build here")
            return 1
        print(f"build {v}: {Path(lib._name).name} ({'OpenMP' if lib.irm_openmp() else 'one thread'})")
    rows = []
    for kernel, shape, torch_fn, native_fn in cases(set(args.only.split(",")) if args.only else None):
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            with torch.no_grad():
                t = compare(torch_fn, native_fn, variants, args.repeats)
            rows.append(
                (
                    kernel,
                    shape,
                    threads,
                    f"{t[0] * 1e3:.3f}",
                    *[c for x in t[1:] for c in (f"{x * 1e3:.3f}", f"{t[0] / x:.2f}")],
                )
            )
            print(*rows[-1], sep="\t", flush=True)
    print(
        table(
            ("kernel", "shape", "threads", "torch ms", *[c for v in variants for c in (f"{v} ms", "torch / it")]), rows
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
