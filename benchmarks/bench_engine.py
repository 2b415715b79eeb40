"""Throughput of Irminsul's engine against transformers on the same weights and token ids, measured
in the same run, one thread:

  batch    N prompts of P tokens, G new tokens each (greedy, EOS ignored): `LLM.generate(list)`
           against transformers' `generate` on the left-padded batch;
  prefill  one prompt of L tokens: the engine's prefill against transformers' forward;
  decode   G tokens at depth L, one sequence: the engine's steps against transformers' forward
           with its KV cache.

    python benchmarks/bench_engine.py [--model DIR] [--batch 32] [--prompt 100] [--new 64] [--depth 1500]

Without --model it uses the bundled MLA model (DeepSeek-V2 architecture). Ratios > 1 mean the
engine is faster.
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
from irminsul.engine.sampling import SamplingParams
from irminsul.machine import best_of, describe


def engine_prefill_decode(llm: LLM, long: list[int], new: int) -> tuple[float, float]:
    """(seconds to prefill `long`, seconds to decode `new` tokens after it), one sequence, best runs."""
    engine = llm.engine

    def prefill():
        seq = engine.add(long, SamplingParams(max_tokens=1, ignore_eos=True))
        while seq.in_prefill:
            engine.execute([seq])
        engine.finish(seq)

    def decode():
        seq = engine.add(long, SamplingParams(max_tokens=new + 1, ignore_eos=True))
        engine.reserve([seq])
        engine.execute([seq])  # the prefill and the first token
        t = time.perf_counter()
        while not seq.finished:
            engine.reserve([seq])
            engine.execute([seq])
        elapsed = time.perf_counter() - t
        engine.finish(seq)
        return elapsed

    return best_of(prefill, 3), min(decode() for _ in range(2))


def ours(llm: LLM, prompts: list[list[int]], new: int, long: list[int]) -> dict[str, float]:
    def batch():
        llm.generate(prompts, max_tokens=new, ignore_eos=True)

    batch()  # warm-up
    prefill, decode = engine_prefill_decode(llm, long, new - 1)
    return {"batch": best_of(batch, 2), "prefill": prefill, "decode": decode}


def transformers_side(path: Path, prompts: list[list[int]], new: int, long: list[int]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    one = torch.tensor([long])

    @torch.inference_mode()
    def batch():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
        )

    @torch.inference_mode()
    def prefill():
        model(one, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def decode():
        out = model(one, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        cache = out.past_key_values
        t = time.perf_counter()
        for _ in range(new - 1):
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - t

    batch()  # warm-up
    return {"batch": best_of(batch, 2), "prefill": best_of(prefill, 3), "decode": min(decode() for _ in range(2))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled MLA model)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--depth", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 avoids stalls on a shared box)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else bundled_model("mla")
    llm = LLM(path)
    llm.wait_compiled()  # timed once the decode steps compiling in the background are ready
    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, vocab, args.prompt).tolist() for _ in range(args.batch)]
    long = rng.integers(10, vocab, args.depth).tolist()
    print(f"machine: {describe()}")
    print(f"model: {path}\n")
    a = ours(llm, prompts, args.new, long)
    b = transformers_side(path, prompts, args.new, long)
    rows = (
        ("batch", f"{args.batch} x ({args.prompt} + {args.new} new)", args.batch * args.new),
        ("prefill", f"{args.depth} tokens", args.depth),
        ("decode", f"{args.new - 1} at depth {args.depth}", args.new - 1),
    )
    print(f"{'case':8} {'shape':24} {'irminsul tok/s':>15} {'transformers tok/s':>19} {'ratio':>7}")
    for key, shape, n in rows:
        print(f"{key:8} {shape:24} {n / a[key]:15.1f} {n / b[key]:19.1f} {b[key] / a[key]:6.2f}x")


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
