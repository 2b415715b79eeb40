"""The Triton kernels' tile sizes on this GPU: each candidate timed against the default in the same
run, and its output checked against the default's, per shape.

    python benchmarks/gpu_tiles.py            # on a GPU (gpu_check.sh runs it): DeepSeek-V2-Lite's shapes, bf16
    python benchmarks/gpu_tiles.py --tiny     # on a CPU, TRITON_INTERPRET=1: tiny shapes, a few candidates
                                              # (checks the script and the candidates' outputs, times nothing useful)

- attention (`model/attention/triton.py: mla_attention`): decode rows of B sequences over T keys each, and one
  sequence's prefill span (causal); candidates: keys per inner step (block_t) x warps;
- routed experts (`triton_moe.fused_experts`): n tokens, each routed to k of E experts; candidates:
  `MoeTiles` (rows per block, columns, inner step, warps, stages).

It prints, per shape, the default's time, the best candidate, default / best, and any candidate
whose output differs from the default's. The defaults in the two modules were not chosen on a GPU;
this is how the first session with one picks them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from irminsul.machine import describe
from irminsul.model.attention import SeqAttention
from irminsul.model.config import ModelConfig
from irminsul.model.rope import Rotary

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check import TINY, V2_LITE, gpu_name  # noqa: E402  (a sibling script: the same shapes)


def timed(fn) -> float:
    """Milliseconds per call: Triton's do_bench on a GPU; one call under the interpreter."""
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=40)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def sweep(name: str, default: dict, candidates: list[dict], run) -> dict:
    """Time run(**candidate) for the default and each candidate; check each output against the default's."""
    want = run(**default)
    base = timed(lambda: run(**default))
    best, best_ms, wrong, failed = default, base, [], []
    for cand in candidates:
        try:
            got = run(**cand)
        except Exception as e:  # a tile too large for the GPU's registers or shared memory
            failed.append(f"{cand}: {type(e).__name__}")
            continue
        err = (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
        if not err < 2e-2:  # bf16: products rounded in another order
            wrong.append(f"{cand}: relative error {err:.2e}")
            continue
        ms = timed(lambda: run(**cand))
        if ms < best_ms:
            best, best_ms = cand, ms
    print(f"{name:<36} default {base:9.4f} ms   best {best_ms:9.4f} ms  {base / best_ms:5.2f}x  {best}", flush=True)
    for line in wrong:
        print(f"    OUTPUT DIFFERS: {line}", flush=True)
    return {
        "shape": name,
        "default": default,
        "default_ms": base,
        "best": best,
        "best_ms": best_ms,
        "speedup": base / best_ms,
        "wrong": wrong,
        "failed": failed,
    }


def attention_cases(cfg: ModelConfig, device, dtype, tiny: bool):
    """(name, run(block_t, num_warps)) per shape: decode of B x T keys, and a prefill span."""
    from irminsul.model.attention.triton import TritonAttention, mla_attention

    rotary = Rotary(cfg.rope, device)
    backend = TritonAttention(cfg, rotary)
    h, r, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    shapes = (
        [("decode", 2, 40), ("decode", 4, 70), ("prefill", 24, 40)]
        if tiny
        else [("decode", 1, 4096), ("decode", 32, 2048), ("decode", 128, 1024), ("prefill", 512, 2048)]
    )
    g = torch.Generator(device="cpu").manual_seed(0)
    for kind, a, b in shapes:
        if kind == "decode":  # a sequences of b keys
            seqs = [SeqAttention(np.array([b - 1]), np.arange(1 + i * b, 1 + (i + 1) * b)) for i in range(a)]
            n, slots, offsets = a, a * b + 1, list(range(a))
        else:  # one sequence: a new positions after b - a cached ones
            seqs = [SeqAttention(np.arange(b - a, b), np.arange(1, b + 1))]
            n, slots, offsets = a, b + 1, [0]
        plan = backend.plan(seqs, offsets, device)
        pool = (torch.randn(slots, r + rope, generator=g) * 0.5).to(device, dtype)
        q_lat = torch.randn(n, h, r, generator=g).to(device, dtype)
        q_pe = torch.randn(n, h, rope, generator=g).to(device, dtype)
        cos, sin = rotary.table(plan.max_pos + 1, device)

        def run(block_t, num_warps, plan=plan, pool=pool, q_lat=q_lat, q_pe=q_pe, cos=cos, sin=sin):
            return mla_attention(
                q_lat,
                q_pe,
                pool,
                plan,
                cos,
                sin,
                cfg.softmax_scale,
                rotary.config.cache_layout == "interleaved",
                block_t,
                backend.SPLIT,
                num_warps=num_warps,
            )

        yield f"attention {kind} {a} x {b}", run


def moe_cases(cfg: ModelConfig, device, dtype, tiny: bool):
    """(name, run(**MoeTiles fields)) per token count."""
    from irminsul.model.triton_moe import MoeTiles, fused_experts

    e, k, hidden, inner = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator(device="cpu").manual_seed(1)
    gate_up = (torch.randn(e, hidden, 2 * inner, generator=g) * hidden**-0.5).to(device, dtype)
    down = (torch.randn(e, inner, hidden, generator=g) * inner**-0.5).to(device, dtype)
    for n in (1, 5, 37) if tiny else (1, 32, 128, 2048):
        x = torch.randn(n, hidden, generator=g).to(device, dtype)
        ids = torch.rand(n, e, generator=g).argsort(-1)[:, :k].to(device)  # k distinct experts per token
        w = torch.rand(n, k, generator=g).to(device)

        def run(x=x, ids=ids, w=w, **tiles):
            return fused_experts(x, w, ids, gate_up, down, MoeTiles(**tiles))

        yield f"experts {n} tokens ({e} experts, k {k})", run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (checks the script, not the GPU)")
    ap.add_argument("--out", default="runs/gpu-check")
    args = ap.parse_args()
    tiny = args.tiny or not torch.cuda.is_available()
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    cfg = ModelConfig.from_dict(TINY if tiny else V2_LITE)
    print(
        f"machine: {describe()}\ngpu: {gpu_name()}\nshapes: {'tiny' if tiny else 'DeepSeek-V2-Lite'} ({dtype})",
        flush=True,
    )
    from irminsul.model.triton_moe import TILES

    results = []
    attn = [
        dict(block_t=t, num_warps=w)
        for t, w in (((16, 4), (64, 4)) if tiny else itertools.product((16, 32, 64, 128), (2, 4, 8)))
    ]
    for name, run in attention_cases(cfg, device, dtype, tiny):
        results.append(sweep(name, dict(block_t=32, num_warps=None), attn, run))
    moe = [
        dict(block_m=m, block_n=n, block_k=kk, num_warps=w, num_stages=s)
        for m, n, kk, w, s in (
            ((16, 16, 16, 4, 2), (32, 64, 32, 4, 2))
            if tiny
            else itertools.product((16, 64), (64, 128), (64, 128), (4, 8), (3,))
        )
    ]
    for name, run in moe_cases(cfg, device, dtype, tiny):
        results.append(sweep(name, TILES._asdict(), moe, run))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_tiles.json").write_text(
        json.dumps({"machine": describe(), "gpu": gpu_name(), "tiny": tiny, "results": results}, indent=1)
    )
    print(f"wrote {out / 'gpu_tiles.json'}")


if __name__ == "__main__":
    main()
