"""Do arriving prompts stall the running streams? Inter-token latency of 8 decoding streams while a
burst of 16 long prompts arrives, against the same streams over the same steps without the burst
(decoding slows as their contexts grow, so the baseline is the same window), in one run:

  alone    the 8 streams, W warm-up steps, then the window;
  burst    the same 8 streams; at the window's start 16 prompts of --burst-len new tokens arrive and
           are admitted and prefilled beside them; the window ends when all have their first token.

Once with the scheduler's prefill sizing (a step that carries prefill takes at most
`decode_slowdown` = 2x a decode-only step) and once without it (every step takes up to
max_prefill_tokens of prompt), so the table shows what the sizing buys and what it costs the
burst's time to first token. The burst's requests stop at their first token: their own decoding
would rightly slow every step, and what is measured is admission and prefill beside the streams.

    python benchmarks/bench_admission.py [--model DIR] [--streams 8] [--burst 16] [--burst-len 1500]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from irminsul import LLM
from irminsul.cli import run_for_people
from irminsul.engine.build import build_engine
from irminsul.engine.config import EngineConfig
from irminsul.engine.sampling import SamplingParams
from irminsul.machine import describe

WARM = 20


def run(llm: LLM, slowdown: float | None, streams: int, burst: int, burst_len: int, window: int | None) -> dict:
    """window None: with the burst, until its last first token; else: that many steps, no burst."""
    llm.engine.close()
    engine = build_engine(
        EngineConfig.of(reuse=llm.reuse, decode_slowdown=slowdown), llm.model, llm.tokenizer, pool=llm.engine.pool
    )
    rng = np.random.default_rng(0)
    vocab = llm.model.config.vocab_size
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    running = [engine.new_sequence(rng.integers(10, vocab, 100).tolist(), params) for _ in range(streams)]
    for seq in running:
        engine.add_request(seq)
    ids = {seq.id for seq in running}
    last: dict[int, float] = {}
    gaps, ttft, arrivals = [], {}, {}
    step = 0
    while True:
        if step == WARM and window is None:
            for _ in range(burst):
                seq = engine.new_sequence(rng.integers(10, vocab, burst_len).tolist(), SamplingParams(max_tokens=1))
                arrivals[seq.id] = time.perf_counter()
                engine.add_request(seq)
        outs = engine.step()
        now = time.perf_counter()
        step += 1
        for out in outs:
            sid = out.seq.id
            if out.token is None:
                continue
            if sid in arrivals and sid not in ttft:
                ttft[sid] = now - arrivals[sid]
            if sid in ids:
                if sid in last and step > WARM:
                    gaps.append(now - last[sid])
                last[sid] = now
        if (window is None and len(ttft) == burst) or (window is not None and step >= WARM + window):
            break
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):  # (the bench's own streams)
        engine.abort(seq)
    engine.close()
    out = {"steps": step - WARM, "p50": np.percentile(gaps, 50), "p99": np.percentile(gaps, 99)}
    if ttft:
        out |= {"ttft_p50": np.percentile(list(ttft.values()), 50), "ttft_max": max(ttft.values())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled MLA model)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--burst-len", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, reuse="pic")
    llm.wait_compiled()  # timed once the decode steps compiling in the background are ready
    print(f"machine: {describe()}")
    print(f"{args.streams} streams decoding; a burst of {args.burst} prompts of {args.burst_len} new tokens arrives\n")
    print(
        f"{'prefill sizing':18} {'window':>7} {'ITL p50 alone':>14} {'ITL p99 alone':>14} {'ITL p50 burst':>14} "
        f"{'ITL p99 burst':>14} {'p99 ratio':>10} {'burst TTFT p50':>15} {'TTFT max':>9}"
    )
    for name, slowdown in (("decode_slowdown 2", 2.0), ("none", None)):
        b = run(llm, slowdown, args.streams, args.burst, args.burst_len, window=None)
        a = run(llm, slowdown, args.streams, args.burst, args.burst_len, window=b["steps"])
        print(
            f"{name:18} {b['steps']:7d} {a['p50'] * 1e3:12.1f}ms {a['p99'] * 1e3:12.1f}ms {b['p50'] * 1e3:12.1f}ms "
            f"{b['p99'] * 1e3:12.1f}ms {b['p99'] / a['p99']:9.2f}x {b['ttft_p50']:14.2f}s {b['ttft_max']:8.2f}s"
        )


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
