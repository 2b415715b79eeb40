"""Long-prompt prefill at real MLA shapes: tok/s and peak RSS, SDPA's flash path against the old math path.

Builds a random DeepSeek-V3 checkpoint with the project's own maker at Moonlight-16B / V2-Lite attention
shapes (hidden 2048, 16 heads, kv_lora 512 + rope 64, qk_nope 128, v 128; 2 layers, a few routed
experts, a small vocabulary: enough to show attention's memory), then prefills prompts of each length
through `irminsul.LLM` (reuse off, the engine's own chunked prefill of max_prefill_tokens rows a pass:
the first chunk causal, the later ones masked), each length and path in a fresh process:

- `new`: expanded attention as the engine runs it (`CPUAttention.EQUAL_WIDTHS`: v padded to the
  q·k width, so SDPA runs its CPU flash kernel);
- `old`: the unpadded call (q·k 192, v 128), which SDPA sends to its math kernel.

Each process prefills `--repeats` times (the first is also printed on its own: first sight pays
oneDNN primitive creation) and reports the middle time and its peak RSS (VmHWM), also over the RSS
after loading. A watchdog ends a process whose RSS passes `--max-rss-gb` (reported as such, not a
crash of the machine). Also the attention op alone (one 16-head SDPA call: n x n causal, by the
flag and by an explicit mask, and the last 2,048-row chunk of an n-token prompt, masked, as the
engine's later chunks call it).
Prints the CPU model and the new/old ratios measured in this run.

    OMP_NUM_THREADS=1 python benchmarks/bench_long_prefill.py                 # 1k, 4k, 16k; bf16
    OMP_NUM_THREADS=1 python benchmarks/bench_long_prefill.py --lengths 1024 --paths new
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHAPES = dict(
    hidden_size=2048,
    intermediate_size=5632,
    moe_intermediate_size=1408,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    q_lora_rank=None,
    vocab_size=32768,
    max_position_embeddings=32768,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
)


def _status(key: str) -> float:
    """A /proc/self/status field in GiB (VmRSS, VmHWM)."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20
    raise KeyError(key)


def _watchdog(limit_gib: float) -> None:
    def watch():
        while True:
            if _status("VmRSS") > limit_gib:
                print(json.dumps({"killed_at_gib": limit_gib}), flush=True)
                os._exit(3)
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()


def child(args) -> None:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    _watchdog(args.max_rss_gb)
    from irminsul import LLM
    from irminsul.model.attention.cpu import CPUAttention

    CPUAttention.EQUAL_WIDTHS = args.child_path == "new"
    llm = LLM(
        args.checkpoint,
        dtype=args.dtype,
        compile_decode=False,
        kv_cache_gib=0.5,
        max_prefill_tokens=args.max_prefill_tokens,
    )
    loaded = _status("VmRSS")
    rng = np.random.default_rng(0)
    times = []
    for _ in range(args.repeats):
        ids = rng.integers(300, SHAPES["vocab_size"], args.child_length).tolist()  # a new prompt each time
        t0 = time.perf_counter()
        out = llm.generate(ids, max_tokens=1, ignore_eos=True)
        times.append(time.perf_counter() - t0)
        assert out.stats.computed_tokens >= args.child_length - 1, out.stats
    print(json.dumps({"times": times, "loaded_gib": loaded, "peak_gib": _status("VmHWM")}), flush=True)


def op_child(args) -> None:
    """One SDPA call at the model's widths, as the engine makes it, padded (new) or not (old)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    _watchdog(args.max_rss_gb)
    dt = getattr(torch, args.dtype)
    n, kind = args.child_length, args.op_kind
    m = min(n, args.max_prefill_tokens) if kind == "chunk" else n  # chunk: the prompt's last m rows
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 16, m, 192, generator=g).to(dt)
    k = torch.randn(1, 16, n, 192, generator=g).to(dt)
    v = torch.randn(1, 16, n, 128, generator=g).to(dt)
    visible = (torch.arange(n)[None] <= torch.arange(n - m, n)[:, None])[None, None]  # [1, 1, m, n]
    kw = dict(is_causal=True) if kind == "causal" else dict(attn_mask=visible)
    if args.child_path == "new":
        v = F.pad(v, (0, 64))
    base = _status("VmRSS")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, scale=192**-0.5, **kw)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"times": times, "over_gib": _status("VmHWM") - base}), flush=True)


def _spawn(args, extra: list[str]) -> dict:
    cmd = [
        sys.executable,
        __file__,
        *extra,
        "--dtype",
        args.dtype,
        "--repeats",
        str(args.repeats),
        "--max-rss-gb",
        str(args.max_rss_gb),
        "--max-prefill-tokens",
        str(args.max_prefill_tokens),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def _mid(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def make_checkpoint(out: Path, experts: int, layers: int, dtype: str) -> Path:
    from irminsul.model.random_checkpoint import _finish_weights
    from irminsul.model.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(
        out,
        "v3",
        std=0.1 * (64 / SHAPES["hidden_size"]) ** 0.5,
        n_routed_experts=experts,
        num_hidden_layers=layers,
        **SHAPES,
    )
    _finish_weights(out, dtype, 1, rewrite=dtype != "float32")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--lengths", type=int, nargs="*", default=[1024, 4096, 16384], help="prompt lengths (none: SDPA alone)"
    )
    ap.add_argument("--paths", nargs="+", default=["new", "old"], choices=["new", "old"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--max-prefill-tokens", type=int, default=2048, help="the engine's prefill chunk (its default)")
    ap.add_argument("--max-rss-gb", type=float, default=10.0, help="a process past this RSS is stopped")
    ap.add_argument("--checkpoint", help="an existing checkpoint instead of building one")
    ap.add_argument(
        "--op-lengths",
        type=int,
        nargs="*",
        default=[1500],
        help="SDPA alone, n queries over n keys (causal flag, and an explicit causal mask)",
    )
    ap.add_argument(
        "--chunk-lengths",
        type=int,
        nargs="*",
        default=[16384],
        help="SDPA alone, the last prefill chunk of an n-token prompt (masked)",
    )
    ap.add_argument("--child-length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-path", help=argparse.SUPPRESS)
    ap.add_argument("--op-kind", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_length is not None:
        return op_child(args) if args.op_kind else child(args)

    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if ln.startswith("Model name")
        ),
        "unknown",
    )
    import torch

    print(
        f"CPU: {cpu}; torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}); one thread; "
        f"{args.dtype}; times are the middle of {args.repeats}"
    )
    ops = [(n, kind) for n in args.op_lengths for kind in ("causal", "mask")] + [
        (n, "chunk") for n in args.chunk_lengths
    ]
    if ops:
        print("\nSDPA alone, 16 heads, q·k 192, v 128 (new: v padded to 192); peak memory over the inputs:")
        for n, kind in ops:
            r = {
                p: _spawn(args, ["--child-length", str(n), "--child-path", p, "--op-kind", kind])
                for p in ("new", "old")
            }
            what = f"{min(n, args.max_prefill_tokens)} x {n}" if kind == "chunk" else f"{n} x {n}"
            if any("times" not in x for x in r.values()):
                print(f"  {what:>13} {kind:>6}: {r}")
                continue
            new, old = (_mid(r[p]["times"]) for p in ("new", "old"))
            print(
                f"  {what:>13} {kind:>6}: new {new * 1e3:7.0f} ms, {r['new']['over_gib']:.3f} GiB   "
                f"old {old * 1e3:7.0f} ms, {r['old']['over_gib']:.3f} GiB   speed-up {old / new:.2f}x",
                flush=True,
            )

    if not args.lengths:
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = (
            Path(args.checkpoint)
            if args.checkpoint
            else make_checkpoint(Path(tmp) / "ckpt", args.experts, args.layers, args.dtype)
        )
        made = "" if args.checkpoint else f"{args.layers} layers, {args.experts} routed experts, "
        print(f"\nprefill through irminsul.LLM, {made}chunks of {args.max_prefill_tokens} (checkpoint {path}):")
        print(f"  {'tokens':>6} {'path':>4} {'tok/s':>8} {'first s':>8} {'peak RSS GiB':>12} {'over load':>9}")
        rows = {}
        for n in args.lengths:
            for p in args.paths:
                r = _spawn(args, ["--checkpoint", str(path), "--child-length", str(n), "--child-path", p])
                rows[n, p] = r
                if "times" not in r:
                    what = f"stopped past {r['killed_at_gib']} GiB RSS" if "killed_at_gib" in r else r["error"]
                    print(f"  {n:>6} {p:>4}  {what}")
                    continue
                print(
                    f"  {n:>6} {p:>4} {n / _mid(r['times']):8.1f} {r['times'][0]:8.2f} {r['peak_gib']:12.2f} "
                    f"{r['peak_gib'] - r['loaded_gib']:9.2f}",
                    flush=True,
                )
            new, old = rows.get((n, "new"), {}), rows.get((n, "old"), {})
            if "times" in new and "times" in old:
                print(
                    f"  {n:>6} new/old: tok/s {_mid(old['times']) / _mid(new['times']):.2f}x, "
                    f"peak RSS over load {(new['peak_gib'] - new['loaded_gib']):.2f} vs "
                    f"{(old['peak_gib'] - old['loaded_gib']):.2f} GiB"
                )


if __name__ == "__main__":
    main()
