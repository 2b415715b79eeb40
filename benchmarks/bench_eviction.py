"""What the one eviction order costs while decoding on a full pool.

The same 8 requests (100-token prompts, 128 new tokens each, greedy) on the bundled model, `pic`:
once on a pool with room to spare, once on a pool of the same size whose free rows were first used
up by cached prompts, so admission and decoding must evict (in batches of at least MIN_EVICTION rows) (`KVCacheManager.make_room`).
Prints decode tokens per second of both and their ratio (1.0: eviction costs nothing), the rows
evicted, and the time of one `make_room` on a 200,000-row pool holding ~1,500 registry entries.

    python benchmarks/bench_eviction.py [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from irminsul import LLM
from irminsul.cli import run_for_people
from irminsul.engine.sampling import SamplingParams
from irminsul.engine.sequence import Sequence
from irminsul.kvcache.manager import KVCacheManager
from irminsul.kvcache.pool import LatentPool
from irminsul.machine import describe

sys.path.insert(0, str(Path(__file__).resolve().parent))


def decode_rate(llm: LLM, fill: bool, rng_seed: int = 0) -> tuple[float, int]:
    """Decode tokens per second of 8 requests together, and the rows evicted meanwhile."""
    engine = llm.engine
    engine.close()
    rng = np.random.default_rng(rng_seed)
    vocab = llm.model.config.vocab_size
    if fill:  # cached prompts until the pool has less free than the requests will need
        while engine.pool.free > 600:
            engine.run(
                engine.add(
                    rng.integers(10, vocab, min(900, engine.pool.free - 2)).tolist(), SamplingParams(max_tokens=1)
                )
            )
    evicted = engine.kv.evicted_rows
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    seqs = [engine.new_sequence(rng.integers(10, vocab, 100).tolist(), params) for _ in range(8)]
    for seq in seqs:
        engine.add_request(seq)
    while any(seq.in_prefill or not seq.admitted for seq in seqs):  # prefill (and the first token) untimed
        engine.step()
    t, done = time.perf_counter(), sum(len(s.output_ids) for s in seqs)
    while engine.has_work:
        engine.step()
    rate = (sum(len(s.output_ids) for s in seqs) - done) / (time.perf_counter() - t)
    return rate, engine.kv.evicted_rows - evicted


def make_room_ms(rows: int = 200_000) -> tuple[float, int]:
    """Milliseconds per make_room that must evict, on a pool full of cached prompts (no model)."""
    from irminsul.model.config import ModelConfig
    from irminsul.model.tiny import tiny_config

    cfg = ModelConfig.from_dict(tiny_config("v2"))
    kv = KVCacheManager("pic", LatentPool(cfg, rows + 1, torch.float32), cfg.num_hidden_layers)
    rng = np.random.default_rng(0)
    while kv.pool.free > 3000:
        tokens = rng.integers(5, 250, int(rng.integers(300, 1500))).tolist()
        seq = Sequence(tokens=tokens, prompt_len=len(tokens), params=SamplingParams(max_tokens=1))
        seq.admit(kv.admission(seq))
        seq.place(seq.pending, kv.fresh_rows(seq.pending, [None]))
        seq.take_pending(len(tokens))
        seq.finish_reason = "length"
        kv.free(seq)
    entries = len(kv.registry.entries())
    t, calls = time.perf_counter(), 50
    for _ in range(calls):
        kv.make_room(kv.pool.free + 8)
        kv.pool.alloc(8)  # (held: every call must evict again)
    return (time.perf_counter() - t) / calls * 1e3, entries


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(describe())
    per_row = LLM(reuse="off").engine.pool.bytes_per_slot
    llm = LLM(reuse="pic", kv_cache_gib=6000 * per_row / 2**30)
    decode_rate(llm, fill=False)  # warm-up
    spare, full, lost = [], [], []
    for r in range(args.repeats):
        spare.append(decode_rate(llm, fill=False, rng_seed=r)[0])
        rate, evicted = decode_rate(llm, fill=True, rng_seed=r)
        full.append(rate)
        lost.append(evicted)
    a, b = statistics.median(spare), statistics.median(full)
    print(f"| pool (6,000 rows, pic, 8 x 128 tokens) | decode tok/s (median of {args.repeats}) |")
    print("|---|---:|")
    print(f"| room to spare | {a:.0f} |")
    print(f"| full of cached prompts: admission and decoding evict | {b:.0f} |")
    print(
        f"ratio full / spare: {b / a:.2f} (rows evicted during the run: {statistics.median(lost):.0f}; "
        f"the requests needed 8 x 228)"
    )
    ms, entries = make_room_ms()
    print(f"make_room on a 200,000-row pool holding {entries:,} entries: {ms:.1f} ms per call that evicts")
    return 0


if __name__ == "__main__":
    run_for_people(main)
