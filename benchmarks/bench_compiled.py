"""The compiled decode step against the engine's eager step, in one run: milliseconds per decode step
of B sequences (100-token prompts, greedy, EOS ignored) through `LLM.generate`, for B = 1 to 32.

    python benchmarks/bench_compiled.py [--model DIR] [--prompt 100] [--new 64] [--repeats 3]

A step's time is (generate with `new` tokens - generate with 1) / (new - 1), the best of `repeats`,
so prefill is left out. The compiled step (model/compiled.py, on by default where available) and
`LLM(compile_decode=False)` run the same weights and token ids; ratios > 1 mean the compiled step is
faster.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from irminsul import LLM, bundled_model
from irminsul.cli import run_for_people
from irminsul.errors import UserFacingError
from irminsul.machine import best_of, describe


def step_ms(llm: LLM, prompts: list[list[int]], new: int, repeats: int) -> float:
    def best(n: int) -> float:
        return best_of(lambda: llm.generate(prompts, max_tokens=n, ignore_eos=True), repeats)

    llm.generate(prompts, max_tokens=4, ignore_eos=True)  # warm-up
    return (best(new) - best(1)) / (new - 1) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled MLA model)")
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = Path(args.model) if args.model else bundled_model("mla")
    print(f"machine: {describe()}\nmodel: {model}, 1 thread\n")
    t = time.perf_counter()
    compiled = LLM(model, compile_decode=True)
    print(f"compiled at startup in {time.perf_counter() - t:.1f} s (torch's on-disk caches make later starts faster)")
    if compiled.engine.runner.compiled is None:
        raise UserFacingError("the compiled step is not available here")
    eager = LLM(model, compile_decode=False)
    vocab = eager.model.config.vocab_size
    print(f"\n{'sequences':>9} {'eager ms/step':>14} {'compiled ms/step':>17} {'ratio':>7}")
    for b in (1, 2, 4, 8, 16, 32):
        rng = np.random.default_rng(b)
        prompts = [rng.integers(10, vocab, args.prompt).tolist() for _ in range(b)]
        e, c = (step_ms(llm, prompts, args.new, args.repeats) for llm in (eager, compiled))
        print(f"{b:9d} {e:14.2f} {c:17.2f} {e / c:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
