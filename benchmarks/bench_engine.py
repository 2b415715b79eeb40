"""Prefill and decode throughput of Irminsul's engine against transformers' eager forward on the
same weights (issue 2). Reports tokens/s for both and their ratio, measured in the same run.

    python benchmarks/bench_engine.py [--prefill 512] [--decode 32] [--sizes tiny,mid]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from irminsul.cli import run_for_people
from irminsul.machine import best_of, describe
from irminsul.model.loader import load_model
from irminsul.model.tiny import make_tiny_checkpoint

SIZES = {
    "tiny": {},
    "mid": dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256,
                num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=256,
                qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1),
}


def ours(path: Path, ids: torch.Tensor, decode: int) -> tuple[float, float]:
    model = load_model(path)
    n = ids.shape[0]

    def prefill():
        model.prefill(model.new_rows(n + decode), ids, torch.arange(n))

    def generate():
        seq = model.new_rows(n + decode)
        h = model.prefill(seq, ids, torch.arange(n))
        tok = model.logits(h[-1:]).argmax(-1)
        for p in range(n, n + decode):
            tok = model.logits(model.prefill(seq, tok, torch.tensor([p]))).argmax(-1)

    t_prefill = best_of(prefill, 3)
    return t_prefill, best_of(generate, 2) - t_prefill


def transformers_eager(path: Path, ids: torch.Tensor, decode: int) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    batch = ids[None]

    @torch.inference_mode()
    def prefill():
        model(batch, use_cache=True)

    @torch.inference_mode()
    def generate():
        out = model(batch, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(decode):
            out = model(tok, past_key_values=out.past_key_values, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)

    t_prefill = best_of(prefill, 3)
    return t_prefill, best_of(generate, 2) - t_prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--sizes", default="tiny,mid")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 avoids stalls on a shared box)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {describe()}")
    print(f"prefill {args.prefill} tokens, then {args.decode} greedy decode steps; best of 3 (prefill) / 2 (decode)\n")
    print(f"{'size':6} {'phase':8} {'irminsul tok/s':>15} {'transformers tok/s':>19} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            path = make_tiny_checkpoint(Path(tmp) / size, **SIZES[size])
            ids = torch.randint(0, 250, (args.prefill,), generator=torch.Generator().manual_seed(0))
            ours_p, ours_d = ours(path, ids, args.decode)
            hf_p, hf_d = transformers_eager(path, ids, args.decode)
            for phase, a, b, n in (("prefill", ours_p, hf_p, args.prefill), ("decode", ours_d, hf_d, args.decode)):
                print(f"{size:6} {phase:8} {n / a:15.1f} {n / b:19.1f} {b / a:6.2f}x")


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
