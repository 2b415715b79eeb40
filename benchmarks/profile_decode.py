"""Where an eager decode step's time goes (`compile_decode=False`): torch's profiler over the difference
between two generations (40 and 8 new tokens), per decode step: aten calls and self time by operator.

    python benchmarks/profile_decode.py [--depth 100] [--batch 1] [--top 12]

A decode step of the bundled 6.6 M-parameter model is many small operations; this is the table to
read before trying to make it faster.
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from irminsul import LLM, bundled_model
from irminsul.cli import run_for_people
from irminsul.machine import describe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--depth", type=int, default=100, help="prompt tokens before decoding")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together (distinct prompts)")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {describe()}")
    llm = LLM(args.model or bundled_model("mla"), reuse="off", compile_decode=False)  # the eager step's operations
    prompts = [[300 + (i * 7 + j * 13) % 5000 for i in range(args.depth)] for j in range(args.batch)]
    ids = prompts if args.batch > 1 else prompts[0]
    llm.generate(ids, max_tokens=4, ignore_eos=True)

    def ops(n: int) -> dict:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(ids, max_tokens=n, ignore_eos=True)
        return {e.key: (e.count, e.self_cpu_time_total) for e in prof.key_averages() if e.key.startswith("aten::")}

    short, long = ops(8), ops(40)
    per = {k: ((c - short.get(k, (0, 0))[0]) / 32, (t - short.get(k, (0, 0))[1]) / 32) for k, (c, t) in long.items()}
    calls, self_us = sum(c for c, _ in per.values()), sum(t for _, t in per.values())
    print(
        f"depth {args.depth}, {args.batch} sequence(s): per decode step {calls:.0f} aten calls, "
        f"{self_us / 1e3:.2f} ms of their self time"
    )
    print(f"{'operator':32s} {'calls':>7s} {'self ms':>8s}")
    for k, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"{k:32s} {c:7.1f} {t / 1e3:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
