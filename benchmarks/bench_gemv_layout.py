"""The products a packed model runs, against the bundled model's weight shapes:

1. one row (a decode step's), hot and cold, with nn.Linear's [out, in] layout and the input-major
   [in, out] one that `DeepseekModel.pack` stores; and how many weight bytes one decode token reads;
2. several rows (a batch of decode steps, a prefill), torch's own product (MKL's GEMM) against
   oneDNN's over the weight blocked once (`layers.dnn_weight`), in GFLOP/s.

    python benchmarks/bench_gemv_layout.py

"Cold" is after streaming 64 MB through the caches, as a decode step does between two uses of
one matrix (it reads every layer's weights in between). Why the engine packs its weights: the
cold product is what decoding one sequence pays, and MKL runs its AVX2 code on AMD processors
(README, Engine).
"""

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from irminsul import bundled_model
from irminsul.cli import run_for_people
from irminsul.machine import describe
from irminsul.model.layers import dnn_linear, dnn_weight
from irminsul.model.loader import load_model

FLUSH = torch.empty(64 * 2**20 // 4)


def timed(fn, cold: bool, n: int = 30) -> float:
    """Median microseconds of fn(), each call after a cache flush (cold) or repeated (hot)."""
    out = []
    for _ in range(n + 3):
        if cold:
            FLUSH.add_(1.0)
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return sorted(out[3:])[n // 2] * 1e6


def decode_bytes(model) -> int:
    """Weight bytes one decode token reads: everything but the experts not routed to (k of them
    per MoE layer) and the embedding table (one row)."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters(remove_duplicate=True):
        if "embed_tokens" in name and not cfg.tie_word_embeddings:
            continue
        if ".experts." in name:
            total += p.numel() * p.element_size() * cfg.num_experts_per_tok // cfg.n_routed_experts
        else:
            total += p.numel() * p.element_size()
    return total


def main() -> int:
    torch.set_num_threads(1)
    print(f"machine: {describe()}")
    model = load_model(bundled_model("mla"))
    print(f"weights one decode token reads: {decode_bytes(model) / 2**20:.1f} MiB (fp32)")
    cfg = model.config
    shapes = {"lm_head": (cfg.vocab_size, cfg.hidden_size),
              "q|kv_a": (model.model.layers[0].self_attn.in_proj[0].shape[1], cfg.hidden_size),
              "gate|up (dense)": (2 * cfg.intermediate_size, cfg.hidden_size),
              "expert gate|up": (2 * cfg.moe_intermediate_size, cfg.hidden_size),
              "o_proj": (cfg.hidden_size, cfg.num_attention_heads * cfg.v_head_dim),
              "expert down": (cfg.hidden_size, cfg.moe_intermediate_size)}
    print(f"{'product':18s} {'[out, in]':>12s} {'hot [out,in]':>13s} {'hot [in,out]':>13s} "
          f"{'cold [out,in]':>14s} {'cold [in,out]':>14s} {'cold ratio':>10s}")
    g = torch.Generator().manual_seed(0)
    for name, (out_f, in_f) in shapes.items():
        w = torch.randn(out_f, in_f, generator=g)
        w_in = w.t().contiguous().t()  # the same matrix, stored input-major (a view of [in, out])
        x = torch.randn(1, in_f, generator=g)
        row = [timed(lambda: F.linear(x, w), False), timed(lambda: F.linear(x, w_in), False),
               timed(lambda: F.linear(x, w), True), timed(lambda: F.linear(x, w_in), True)]
        print(f"{name:18s} {str([out_f, in_f]):>12s} {row[0]:11.1f}us {row[1]:11.1f}us {row[2]:12.1f}us "
              f"{row[3]:12.1f}us {row[2] / row[3]:9.2f}x")
    print("\nseveral rows, hot, GFLOP/s: torch's product (F.linear: MKL), oneDNN's over the weight blocked for\n"
          "these rows, and the engine's `dnn_linear` (blocks of 256 and 32 rows; a short tail through MKL)")
    print(f"{'product':18s} {'rows':>6s} {'F.linear':>9s} {'oneDNN':>9s} {'ratio':>7s} {'engine':>9s} {'ratio':>7s}")
    for name, (out_f, in_f) in shapes.items():
        w = torch.randn(out_f, in_f, generator=g)
        dnn = dnn_weight(w)
        for rows in (4, 32, 3200):
            x = torch.randn(rows, in_f, generator=g)
            dnn_any = torch.ops.mkldnn._reorder_linear_weight(w, rows)
            n = max(3, 30_000_000 // (rows * in_f * out_f))
            flop = 2e-3 * rows * in_f * out_f  # per microsecond -> GFLOP/s
            a = flop / timed(lambda: F.linear(x, w), False, n)
            b = flop / timed(lambda: torch.ops.mkldnn._linear_pointwise(x, dnn_any, None, "none", [], ""), False, n)
            if dnn is not None:
                c = flop / timed(lambda: dnn_linear(x, dnn, w, None), False, n)
            print(f"{name:18s} {rows:6d} {a:9.0f} {b:9.0f} {b / a:6.2f}x "
                  + (f"{c:9.0f} {c / a:6.2f}x" if dnn is not None else f"{'(MKL: too small to pay)':>26s}"))
    return 0


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
