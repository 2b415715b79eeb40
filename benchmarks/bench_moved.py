"""A moved document's TTFT under `pic` against an exact-prefix hit that computes as many tokens.

A document seen once behind header A (40 tokens) comes back behind header B (233 tokens): the
moved prompt is header B + the document (1,200 tokens) + a question (8). `pic` reuses the
document's rows at their new positions and computes the rest. Its TTFT (one output token) is set
beside two ideals, each on fresh random tokens: the same prompt length whose first (prompt -
computed) tokens hit an exact-prefix cache, so that it computes as many tokens as `pic` did; and
those computed tokens alone, from nothing. The ratio moved / exact-prefix is what position-
independent reuse costs over the best a prefix cache could do with the same work (target <= 1.2).

    python benchmarks/bench_moved.py                 # torch's default threads (what a user gets)
    python benchmarks/bench_moved.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from irminsul import LLM, bundled_model
from irminsul.cli import run_for_people
from irminsul.machine import describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the clone's root, for tests/support
from tests.support.moved import moved_prompts  # noqa: E402

MOVED = dict(header_a=40, header_b=233, doc=1200, question=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled MLA model)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, the cores it sees)")
    ap.add_argument("--repeat", type=int, default=5, help="documents timed (the median is reported)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else bundled_model("mla")
    llm = LLM(model, reuse="pic")
    llm.wait_compiled()
    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(2)
    print(f"machine: {describe()}\nmodel: {model}\n")

    def ttft(prompt: list[int]):
        t = time.perf_counter()
        out = llm.generate(prompt, max_tokens=1, ignore_eos=True)
        return time.perf_counter() - t, out.stats

    fresh = lambda n: rng.integers(10, vocab, n).tolist()  # noqa: E731
    rows = []
    for i in range(1 + args.repeat):  # (the first: warm-up)
        pair = moved_prompts(**MOVED, seed=100 + i, vocab=vocab)
        llm.generate(pair.first, max_tokens=1, ignore_eos=True)
        moved_s, st = ttft(pair.moved)
        ideal = fresh(len(pair.moved))
        hit = st.prefix_tokens + st.reused_tokens  # what pic took from the cache, taken as an exact prefix
        llm.generate(ideal[:hit], max_tokens=1, ignore_eos=True)
        prefix_s, pst = ttft(ideal)
        alone_s, _ = ttft(fresh(st.computed_tokens))
        if i:
            rows.append((moved_s, prefix_s, alone_s, st.computed_tokens, pst.computed_tokens))
    moved, prefix, alone = (statistics.median(r[k] for r in rows) for k in range(3))
    print(f"prompt {len(pair.moved)} tokens; pic computed {rows[-1][3]}, the exact-prefix hit computed {rows[-1][4]}")
    print(
        f"TTFT moved (pic) {1000 * moved:.1f} ms, exact-prefix hit {1000 * prefix:.1f} ms, "
        f"computed tokens alone {1000 * alone:.1f} ms (medians of {len(rows)})"
    )
    print(f"moved / exact-prefix {moved / prefix:.2f}x (target <= 1.2), moved / alone {moved / alone:.2f}x")


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
