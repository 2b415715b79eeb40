"""Routed experts: the grouped product against the loop over the experts hit, and the engine's choice.

    python benchmarks/bench_moe.py [--model DIR] [--dtype bfloat16] [--rows 1,4,8,32,233,1024]

For each token count, one MoE layer's forward (random hidden states, the checkpoint's own router) is
timed grouped (`MoE._grouped`: every expert padded to the busiest one's rows, two batched products)
and looped (`expert_loop`: each expert hit on its own rows), middle of five, one thread; then the path
`MoE.forward` chose (`MoE._padding_pays`) and its time over the faster one's; and the native kernel
(model/native/moe.c, `MoE._native`: float32, or bf16 with out-major stacks)
timed at every token count, with whether the engine takes it there (the counts
`kernel_choice.native_experts_counts` measured at load on this machine). Default model: the
bundled one. A realistic one: `irminsul checkpoint random DIR --family deepseek_v3 --layers 2
--hidden 2048 --heads 16 --vocab 129280 --experts 64 --kv-lora-rank 512 --rope-head-dim 64
--nope-head-dim 128 --v-head-dim 128 --dtype bfloat16`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from irminsul import LLM
from irminsul.cli import run_for_people
from irminsul.machine import describe, median_of
from irminsul.model import layers
from irminsul.model.layers import MoE
from irminsul.table import table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default="1,4,8,32,233,1024")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    llm = LLM(args.model, dtype=args.dtype, compile_decode=False)
    moe = next(m for m in llm.model.modules() if isinstance(m, MoE))
    dtype = moe.experts[0].gate_proj.weight.dtype
    inner, hidden = moe.experts[0].gate_proj.weight.shape
    print(f"machine  {describe()}")
    print(
        f"model    {args.model or 'bundled'}: {len(moe.experts)} experts of {hidden} x {inner}, top "
        f"{moe.gate.cfg.num_experts_per_tok}, {str(dtype).removeprefix('torch.')}, 1 thread"
    )
    torch.manual_seed(0)
    rows = []
    for n in (int(r) for r in args.rows.split(",")):
        x = torch.randn(n, hidden, dtype=dtype) * 0.5
        weights, ids = moe.gate(x)
        counts = torch.bincount(ids.flatten(), minlength=len(moe.experts))
        cap, hit = int(counts.max()), int((counts > 0).sum())
        grouped = median_of(lambda: moe._grouped(x, weights, ids.reshape(-1), counts, cap))
        looped = median_of(lambda: layers.expert_loop(x, weights, ids, lambda e, xs: moe.experts[e](xs)))
        chose = "grouped" if (n > 1 and moe._padding_pays(n * ids.shape[1], hit, cap)) else "loop"
        best = min(grouped, looped)
        kernel = moe.native_kernel(dtype)
        native = median_of(lambda: kernel(x, weights, ids, *moe.stacked())) if kernel is not None else None
        takes = moe._native(x, weights, ids) is not None
        rows.append(
            (
                n,
                hit,
                f"{len(moe.experts) * cap / (n * ids.shape[1]):.1f}x",
                f"{grouped * 1e3:.2f}",
                f"{looped * 1e3:.2f}",
                f"{looped / grouped:.2f}",
                chose,
                f"{(grouped if chose == 'grouped' else looped) / best:.2f}",
                "-" if native is None else f"{native * 1e3:.2f}",
                "-" if native is None else f"{best / native:.2f}",
                "yes" if takes else "no",
            )
        )
    print(
        table(
            (
                "tokens",
                "experts hit",
                "padded / real rows",
                "grouped ms",
                "loop ms",
                "loop / grouped",
                "engine's choice",
                "choice / best",
                "native ms",
                "best / native",
                "engine takes native",
            ),
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
