"""What position-independent reuse buys and costs on DeepSeek-V4 (docs/deepseek-v4.md).

    python benchmarks/v4_reuse.py [--requests 8] [--seed 0]

A random multi-layer V4 (HCA, CSA and sliding layers, written by transformers) served by the engine in
three modes: `off` (full prefill, the reference), `pic` (cached per-token rows reused at their new
positions, compressed entries pooled at the new alignment) and `naive` (the same rows, keys rotated
where they were computed: the paper's stale baseline). Two workloads, both with shifted content:
  agent_meta: a varying header, then tau-bench's airline policy, then a question;
  rerank: an instruction, then six policy passages in a different order per request, then a question.
Per workload: the share of prompt tokens reused, the KL divergence from full prefill of the next-token
distributions over each request's last 8 prompt positions (pic against naive), and the share of pic's
prefill time spent pooling compressed entries from rows (the re-aggregation). Then cache bytes per
token: what the pool holds (per-token rows) against V4's own cache, for this model and, from its
config alone, for DeepSeek-V4-Flash. Random weights: the KL figures say how far stale keys move a
model that has not learnt to tolerate them, not how a trained V4 behaves.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from irminsul import LLM
from irminsul.cli import run_for_people
from irminsul.data import data_file
from irminsul.machine import describe
from irminsul.model import deepseek_v4
from irminsul.model.deepseek_v4 import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE, make_tiny_v4_checkpoint
from irminsul.research.eval.v4_reuse import shifted_reuse_error

# a small V4: the released model's ratios where they fit (K = V head with a rope slice, CSA every 4,
# HCA every 32 here for 128 there, a window shorter than the prompts)
BENCH_V4 = dict(
    hidden_size=128,
    head_dim=64,
    partial_rotary_factor=0.25,
    num_attention_heads=4,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    sliding_window=64,
    compress_rates={CSA: 4, HCA: 32},
    index_n_heads=2,
    index_head_dim=32,
    index_topk=8,
    hc_mult=2,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    num_hidden_layers=6,
    layer_types=[HCA, CSA, SLIDING, HCA, CSA, HCA],
    mlp_layer_types=[HASH_MOE, HASH_MOE, TOPK_MOE, TOPK_MOE, TOPK_MOE, TOPK_MOE],
)
# DeepSeek-V4-Flash as transformers' DeepseekV4Config describes it (43 layers: 2 HCA, then CSA / HCA)
FLASH = dict(
    head_dim=512,
    index_head_dim=128,
    sliding_window=128,
    csa=4,
    hca=128,
    layer_types=[HCA] * 2 + [CSA if i % 2 else HCA for i in range(41)],
)


def policy(llm: LLM) -> list[int]:
    return llm.tokenizer.encode(data_file("tau_bench", "airline_wiki.md").read_text(), add_bos=False)


def agent_meta(llm: LLM, n: int, rng) -> list[list[int]]:
    body, tok = policy(llm)[:900], llm.tokenizer
    out = []
    for i in range(n):
        header = tok.encode(
            f"request_id={rng.integers(1e9)} agent=support "
            + " ".join(f"pref{int(x)}" for x in rng.integers(0, 1000, int(rng.integers(1, 25))))
            + "\n"
        )
        out.append(header + body + tok.encode(f"\nQuestion {i}: may I change my seat?", add_bos=False))
    return out


def rerank(llm: LLM, n: int, rng) -> list[list[int]]:
    text, tok = policy(llm), llm.tokenizer
    passages = [text[i * 150 : (i + 1) * 150] for i in range(6)]
    out = []
    for i in range(n):
        docs = [d for j in rng.permutation(6) for d in tok.encode(f"\n[doc {j}] ", add_bos=False) + passages[j]]
        out.append(
            tok.encode("Rank the passages for the question.")
            + docs
            + tok.encode(f"\nQuestion {i}: which passage covers refunds?", add_bos=False)
        )
    return out


def kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean KL(ref || got) over rows of log-probabilities."""
    return (ref.exp() * (ref - got)).sum(-1).mean().item()


class PoolTimer:
    """Seconds spent in WindowPool.entries (pooling compressed entries from rows)."""

    def __init__(self):
        self.seconds = 0.0
        self._orig = deepseek_v4.WindowPool.entries

        def timed(pool, rows, rot, _orig=self._orig):
            t = time.perf_counter()
            out = _orig(pool, rows, rot)
            self.seconds += time.perf_counter() - t
            return out

        deepseek_v4.WindowPool.entries = timed

    def close(self):
        deepseek_v4.WindowPool.entries = self._orig


def workload(path: Path, build, n: int, seed: int) -> dict:
    llms = {mode: LLM(path, reuse=mode) for mode in ("off", "pic", "naive")}
    requests = build(llms["off"], n + 1, np.random.default_rng(seed))
    out = {}
    refs = [llms["off"].score(r[:-8], r[-8:]) for r in requests[1:]]
    for mode in ("pic", "naive"):
        llm = llms[mode]
        llm.generate(requests[0], max_tokens=1)  # caches the first request's content
        kls, reused, prompt, pooled, total = [], 0, 0, [], []
        for r, ref in zip(requests[1:], refs):
            timer = PoolTimer()
            t = time.perf_counter()
            try:
                got = llm.score(r[:-8], r[-8:])
            finally:
                timer.close()
            total.append(time.perf_counter() - t)
            pooled.append(timer.seconds)
            kls.append(kl(ref, got))
            reused += llm.last_stats.reused_tokens
            prompt += llm.last_stats.prompt_tokens
            llm.generate(r, max_tokens=1)  # and caches this one's too
        out[mode] = dict(kl=statistics.mean(kls), reused=reused / prompt, pooling=sum(pooled) / sum(total))
    return out


def native_bytes_per_token(layer_types, head_dim: int, index_dim: int, csa: int, hca: int) -> float:
    """V4's own cache per token of a long prompt (the window's keys amortise to nothing): one entry of
    head_dim per `rate` tokens on compressed layers, plus the indexer's keys on CSA layers."""
    per = 0.0
    for kind in layer_types:
        if kind == CSA:
            per += (head_dim + index_dim) / csa
        elif kind == HCA:
            per += head_dim / hca
    return per


def rows_per_token(layer_types, head_dim: int, index_dim: int) -> int:
    """The pool's per-token row, summed over layers (elements): the key, then on compressed layers the
    pooling inputs [kv | gate] (two series each on CSA, and the indexer's two series)."""
    per = 0
    for kind in layer_types:
        per += head_dim
        if kind == HCA:
            per += 2 * head_dim
        elif kind == CSA:
            per += 4 * head_dim + 4 * index_dim
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--model",
        default=None,
        help="a DeepSeek-V4 checkpoint for the workloads (default: a random six-layer one); e.g. the "
        "one `irminsul train-reference --arch v4 --attn-weight 0` trains",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {describe()}")
    with tempfile.TemporaryDirectory() as tmp:
        print("one layer, content reused at another position: max |Δ log-prob| against full prefill")
        for kind in (HCA, CSA, SLIDING):
            one = dict(BENCH_V4, num_hidden_layers=1, layer_types=[kind], mlp_layer_types=[TOPK_MOE])
            model = deepseek_v4.load_deepseek_v4(make_tiny_v4_checkpoint(Path(tmp) / kind, seed=args.seed, **one))
            cells = [
                f"shift {b - a:+d}: pic {shifted_reuse_error(model, a, b, 96, seed=args.seed):.1e}, "
                f"naive {shifted_reuse_error(model, a, b, 96, naive=True, seed=args.seed):.1e}"
                for a, b in ((3, 35), (3, 8), (40, 8))
            ]
            print(f"  {kind:30s} " + "; ".join(cells))
        print()
        path = Path(args.model) if args.model else make_tiny_v4_checkpoint(Path(tmp) / "v4", seed=args.seed, **BENCH_V4)
        cfg = deepseek_v4.V4Config.from_dict(json.loads((path / "config.json").read_text()))
        print(
            f"model: {args.model or 'random DeepSeek-V4'}, layers {list(cfg.layer_types)}, window "
            f"{cfg.sliding_window}, CSA rate {cfg.csa_rate}, HCA rate {cfg.hca_rate}, fp32\n"
        )
        for name, build in (("agent_meta", agent_meta), ("rerank", rerank)):
            res = workload(path, build, args.requests, args.seed)
            print(
                f"{name}: reused {res['pic']['reused']:.1%} of prompt tokens; KL from full prefill over the last "
                f"8 prompt positions: pic {res['pic']['kl']:.2e}, naive {res['naive']['kl']:.2e} "
                f"(pic {1 - res['pic']['kl'] / res['naive']['kl']:.1%} lower); pooling entries from rows: "
                f"{res['pic']['pooling']:.1%} of pic's prefill time"
            )
        llm = LLM(path)
        widths = llm.model.widths
    mine = rows_per_token(cfg.layer_types, cfg.head_dim, cfg.index_head_dim)
    assert mine == sum(widths), (mine, widths)  # the formula is the pool's own row
    native = native_bytes_per_token(cfg.layer_types, cfg.head_dim, cfg.index_head_dim, cfg.csa_rate, cfg.hca_rate)
    print(
        f"\ncache per token (elements, all layers): the pool's rows {mine}, V4's own cache {native:.1f} "
        f"({mine / native:.0f}x)"
    )
    f = FLASH
    flash_rows = rows_per_token(f["layer_types"], f["head_dim"], f["index_head_dim"])
    flash_native = native_bytes_per_token(f["layer_types"], f["head_dim"], f["index_head_dim"], f["csa"], f["hca"])
    print(
        f"DeepSeek-V4-Flash (from its config): rows {flash_rows} elements a token, V4's own cache "
        f"{flash_native:.0f} ({flash_rows / flash_native:.0f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
