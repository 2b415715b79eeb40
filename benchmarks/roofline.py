"""Where the time can go at most: a model's decode and prefill limits on this machine, one thread.

    python benchmarks/roofline.py [--checkpoint DIR] [--dtype bfloat16] [--depth 1500] [--prompt 1500]
                                  [--measured FILE.json]

Decode is bound by memory: each token reads every weight it uses once (attention, the dense layers,
the k routed experts it picks and the shared ones, the LM head; one embedding row) plus the cached
rows it attends to, so its ceiling is the bytes a token reads over the bandwidth one thread streams
(measured here two ways: a plain sum over 1 GiB, and a matrix-vector product over a weight of the
model's own dtype as large as its LM head, which is what a decode step is made of). Prefill is bound
by the multiply-adds: the FLOPs per prompt token (`research/eval/accounting.py`, the engine's own
attention-form rule) over the rate one thread multiplies a [prompt, hidden] x [hidden, hidden]
product at in that dtype (the faster of the two weight layouts).

`--measured` takes `bench_real_shapes.py --json`'s output and prints each engine's decode and prefill
tokens/s as a share of these ceilings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from irminsul.cli import run_for_people
from irminsul.errors import UserFacingError
from irminsul.machine import describe
from irminsul.research.eval.accounting import Arch, Pass, forward_bytes, forward_flops

BUNDLED = Path(__file__).resolve().parent.parent / "irminsul" / "bundled" / "mla"


def _median_time(fn, repeats: int = 5) -> float:
    fn()  # first call: page faults, kernel selection
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def stream_bandwidth(dtype: torch.dtype, hidden: int, vocab: int) -> dict[str, float]:
    """GB/s one thread reads: a sum over 1 GiB, and x @ W over a [hidden, vocab] weight (both layouts)."""
    big = torch.ones(2**30 // 4, dtype=torch.float32)
    out = {"sum over 1 GiB (fp32)": big.numel() * 4 / _median_time(big.sum) / 1e9}
    del big
    w = torch.randn(vocab, hidden).to(dtype)  # out-major, nn.Linear's layout
    x = torch.randn(1, hidden).to(dtype)
    size = w.numel() * w.element_size()
    out[f"F.linear, [{vocab}, {hidden}] {str(dtype).split('.')[-1]}"] = (
        size / _median_time(lambda: torch.nn.functional.linear(x, w)) / 1e9
    )
    wt = w.t().contiguous()
    out[f"x @ W, [{hidden}, {vocab}] {str(dtype).split('.')[-1]}"] = size / _median_time(lambda: x @ wt) / 1e9
    return out


def matmul_rate(dtype: torch.dtype, rows: int, hidden: int) -> dict[str, float]:
    """GFLOP/s of a [rows, hidden] x [hidden, hidden] product, one thread, with the weight in either
    layout (`F.linear` on [out, in], `x @ W` on [in, out]): on some CPUs one of them is far slower."""
    a, w = torch.randn(rows, hidden).to(dtype), torch.randn(hidden, hidden).to(dtype)
    wt = w.t().contiguous()
    flops = 2.0 * rows * hidden * hidden
    rates = {
        "F.linear": flops / _median_time(lambda: torch.nn.functional.linear(a, w), repeats=3) / 1e9,
        "x @ W": flops / _median_time(lambda: a @ wt, repeats=3) / 1e9,
    }
    if dtype != torch.float32:  # the weight kept in its dtype, upcast for each call, multiplied in fp32
        a32 = a.float()
        rates["weight upcast per call, then fp32 F.linear"] = (
            flops / _median_time(lambda: torch.nn.functional.linear(a32, w.float()), repeats=3) / 1e9
        )
    return rates


def decode_bytes(arch: Arch, depth: int, dtype_bytes: int) -> dict[str, float]:
    """What one decode token at `depth` reads: the weights it uses (one embedding row, not the table)
    and the cached rows of every layer."""
    p = Pass.causal([depth])
    b = forward_bytes(arch, p, dtype_bytes)
    weights = b["weights"] - (arch.vocab - 1) * arch.hidden * dtype_bytes
    lm_head = arch.vocab * arch.hidden * dtype_bytes
    return {
        "weights": weights,
        "of which LM head": lm_head,
        "cached rows": b["kv_read"],
        "total": weights + b["kv_read"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=BUNDLED, help="a model directory (default: the bundled MLA)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="the weights' dtype (default: the checkpoint's torch_dtype, else float32)",
    )
    p.add_argument("--depth", type=int, default=1500, help="decode at this many cached tokens (default 1500)")
    p.add_argument("--prompt", type=int, default=1500, help="prefill of this many tokens (default 1500)")
    p.add_argument("--measured", type=Path, default=None, help="bench_real_shapes.py --json output")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config_path = args.checkpoint / "config.json"
    if not config_path.exists():
        raise UserFacingError(f"{config_path} does not exist: give --checkpoint a model directory")
    raw = json.loads(config_path.read_text())
    arch = Arch.from_config(raw, args.checkpoint.name)
    dtype_name = args.dtype or ("bfloat16" if raw.get("torch_dtype") == "bfloat16" else "float32")
    dtype = getattr(torch, dtype_name)
    size = torch.tensor([], dtype=dtype).element_size()

    print(f"machine: {describe()}")
    print(
        f"model: {args.checkpoint} ({arch.layers} layers, hidden {arch.hidden}, vocab {arch.vocab}), "
        f"{dtype_name}, one thread\n"
    )
    bw = stream_bandwidth(dtype, arch.hidden, arch.vocab)
    for what, gbs in bw.items():
        print(f"bandwidth, {what}: {gbs:.1f} GB/s")
    rates = matmul_rate(dtype, args.prompt, arch.hidden)
    for what, gflops in rates.items():
        print(
            f"multiply rate, {what}, [{args.prompt}, {arch.hidden}] x [{arch.hidden}, {arch.hidden}] {dtype_name}: "
            f"{gflops:.1f} GFLOP/s"
        )
    rate = max(v for k, v in rates.items() if not k.startswith("weight upcast"))  # (what the engine runs today)
    print()

    d = decode_bytes(arch, args.depth, size)
    gemv = max(v for k, v in bw.items() if not k.startswith("sum"))
    print(
        f"decode at depth {args.depth}: {d['total'] / 1e6:.1f} MB a token (weights {d['weights'] / 1e6:.1f}, "
        f"of which the LM head {d['of which LM head'] / 1e6:.1f}; cached rows {d['cached rows'] / 1e6:.1f})"
    )
    decode_ceiling = gemv * 1e9 / d["total"]
    print(f"  ceiling at the faster product's bandwidth ({gemv:.1f} GB/s): {decode_ceiling:.1f} tok/s")

    prefill = forward_flops(arch, Pass.causal(np.arange(args.prompt)))
    per_token = prefill["total"] / args.prompt
    prefill_ceiling = rate * 1e9 / per_token
    print(
        f"prefill of {args.prompt}: {per_token / 1e9:.3f} GFLOP a token (in all: linear "
        f"{prefill['linear'] / 1e9:.1f}, attention {prefill['attention'] / 1e9:.1f}, LM head of the last "
        f"token {prefill['lm_head'] / 1e9:.2f} GFLOP)"
    )
    print(f"  ceiling at the faster product's {rate:.1f} GFLOP/s: {prefill_ceiling:.0f} tok/s")

    if args.measured is not None:
        runs = json.loads(args.measured.read_text())
        engines = {
            "irminsul": (runs.get("irminsul") or {}).get("shapes", {}),
            "llama.cpp": (runs.get("llamacpp") or {}).get("best", {}),
            "vllm": (runs.get("vllm") or {}).get("shapes", {}),
        }
        print(f"\nmeasured ({args.measured}), median tok/s as a share of the ceiling:")
        for engine, shapes in engines.items():
            parts = []
            for shape, ceiling in (("decode", decode_ceiling), ("prefill", prefill_ceiling)):
                got = (shapes.get(shape) or {}).get("median")
                if got:
                    parts.append(f"{shape} {got:.1f} tok/s = {got / ceiling:.0%}")
            if parts:
                print(f"  {engine}: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
