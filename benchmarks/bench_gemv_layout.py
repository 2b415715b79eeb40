"""The linear products a packed model runs, timed the way `DeepseekModel.pack` times them to choose
(model/kernel_choice.py), for a model's own shapes, with the choice made from the times:

  out    torch's product over the weight stored [out, in] (nn.Linear's layout; F.linear)
  in     the same over the weight stored input-major [in, out] (x @ W)
  dnn    oneDNN's over a copy of the weight blocked for that many rows (8, 32, 256)
  gemv   one and eight rows: model/gemv.py's native C loop over the out-major weight's rows (where a
         C compiler built it; IRMINSUL_GEMV=0 leaves it out)
  fixed  the earlier fixed rule's `dnn_linear` (input-major, copies for 256, 32 and 8 rows of every
         float32 weight large enough), at that row count

    python benchmarks/bench_gemv_layout.py [--model DIR | --real] [--dtype float32|bfloat16] [--repeat 3]

Microseconds per call, the middle of --repeat measurements (each already the median of several
interleaved samples): these machines are shared and noisy. One-row and eight-row products are timed
over rotating copies adding up to what the model reads per decode token (as far from the core as its
weights come); larger weights on a slice of their rows, scaled. --real uses a realistic checkpoint's
shapes without one (DeepSeek-V3 at hidden 2048: 16 heads, kv_lora 512 + rope 64, MoE 2048 x 1408,
dense MLP 2048 x 10944, 129,280-token vocabulary).
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

from irminsul import bundled_model
from irminsul.cli import run_for_people
from irminsul.machine import describe
from irminsul.model import gemv, kernel_choice
from irminsul.model.kernel_choice import Product
from irminsul.model.layers import dnn_linear, dnn_weight
from irminsul.model.loader import load_model

REAL = {
    "lm_head": (129280, 2048),
    "q|kv_a": (16 * 192 + 576, 2048),
    "kv_b": (16 * 256, 512),
    "o_proj": (2048, 16 * 128),
    "dense gate|up": (2 * 10944, 2048),
    "dense down": (2048, 10944),
    "expert gate|up": (2 * 1408, 2048),
    "expert down": (2048, 1408),
}
REAL_DECODE_BYTES = 2**30  # (far beyond any cache: every weight cold)


def fixed_times(out: int, inp: int, dtype: torch.dtype, streamed: int) -> dict[int, float]:
    """The fixed rule's dnn_linear (its three copies) at 8, 32 and 256 rows, seconds, timed as `measure`
    times the candidates (8 rows over rotating copies; a slice, scaled)."""
    blocks = kernel_choice.fixed_choice(out, inp, dtype).blocks
    if not blocks:
        return {}
    got = {}
    for rows in (8, 32, 256):
        streams = rows <= kernel_choice.STREAM_ROWS
        sub = kernel_choice.measured_rows(out, inp, dtype, None if streams else kernel_choice.COMPUTE_SLICE_BYTES)
        w = (torch.randn(sub, inp) / inp**0.5).to(dtype)
        size = sub * inp * w.element_size()
        n = max(1, min(kernel_choice.MAX_COPIES, -(-streamed // size))) if streams else 1
        pairs = [(c, dnn_weight(c, blocks=blocks)) for c in (w.clone() for _ in range(n))]
        x = torch.randn(rows, inp).to(dtype)
        at = [0]

        def call():
            c, copy = pairs[at[0]]
            at[0] = (at[0] + 1) % len(pairs)
            return dnn_linear(x, copy, c, None)

        got[rows] = kernel_choice._time({"fixed": call})["fixed"] * out / sub
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled MLA model)")
    ap.add_argument("--real", action="store_true", help="a realistic checkpoint's shapes (no checkpoint needed)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    print(f"machine: {describe()}")
    if args.real:
        products = [Product(o, i, dtype, 1, 1.0) for o, i in REAL.values()]
        names = list(REAL)
        model_bytes = decode_bytes = REAL_DECODE_BYTES
    else:
        model = load_model(args.model or bundled_model("mla"), dtype=args.dtype, pack=False)
        products = kernel_choice._merged(model.products())
        names = [f"[{p.out}, {p.inp}]" + (" (own)" if p.layout else "") for p in products]
        model_bytes, decode_bytes = model._weight_bytes()
    streamed = kernel_choice.stream_bytes(decode_bytes)
    with_gemv = gemv.available(dtype=dtype)
    print(
        f"dtype {args.dtype}; timed over {streamed / 2**20:.0f} MiB of copies at 1 and 8 rows; "
        f"oneDNN a candidate: {kernel_choice.dnn_applies(dtype)}; gemv a candidate: {with_gemv}\n"
    )
    print(
        f"{'product':22s} {'rows':>5s} {'out':>10s} {'in':>10s} {'dnn':>10s} {'gemv':>10s} {'fixed':>10s}  "
        f"{'best/out':>8s}  GB/s of one and eight rows (out, in, gemv)"
    )
    all_times = {}
    for name, p in zip(names, products):
        runs = [
            kernel_choice.measure(p.out, p.inp, p.dtype, streamed, kernel_choice.dnn_applies(dtype), with_gemv)
            for _ in range(args.repeat)
        ]
        times = {r: {c: statistics.median(run[r][c] for run in runs) for c in runs[0][r]} for r in runs[0]}
        all_times[p.key] = times
        fixed = fixed_times(p.out, p.inp, dtype, streamed) if dtype == torch.float32 else {}
        for rows in kernel_choice.ROWS:
            t = times[str(rows)]
            best = min(t.values())
            cell = lambda c: f"{t[c] * 1e6:10.1f}" if c in t else f"{'':>10s}"  # noqa: E731
            fx = f"{fixed[rows] * 1e6:10.1f}" if rows in fixed else f"{'':>10s}"
            gbs = ""
            if rows in (1, kernel_choice.STREAM_ROWS):
                size = p.out * p.inp * kernel_choice._itemsize(dtype) / 1e9
                gbs = f"  {size / t['out']:5.1f}, {size / t['in']:5.1f}" + (
                    f", {size / t['gemv']:5.1f}" if "gemv" in t else ""
                )
            print(
                f"{name if rows == 1 else '':22s} {rows:5d} {cell('out')} {cell('in')} {cell('dnn')} {cell('gemv')} {fx}  "
                f"{t['out'] / best:7.2f}x{gbs}"
            )
    # the choice these times make (the model's copy budget, its counts and uses)
    kernel_choice._memory.update(
        {kernel_choice.entry_key(p.out, p.inp, p.dtype, streamed, with_gemv): all_times[p.key] for p in products}
    )
    choices = kernel_choice.choose(products, model_bytes, decode_bytes, kernels="measured", progress=False)
    print("\nchosen (" + ("one of each shape" if args.real else "this model's counts") + "):")
    for line in kernel_choice.describe(choices):
        print("  ", line)
    return 0


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
