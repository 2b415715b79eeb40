"""Irminsul's engine against llama.cpp on the same model (f32, the same threads each), same shapes, one run:

  one      1 request: 100-token prompt + 64 new tokens      (llama-batched-bench, npl 1)
  batch32  32 concurrent requests of the same shape          (llama-batched-bench, npl 32)
  prefill  one 1,500-token prompt                           (llama-bench -p 1500)
  decode   64 tokens at depth 1,500                          (llama-bench -n 64 -d 1500)

Throughput is tokens processed (prompt + generated) per second; for llama.cpp the better of flash
attention on and off, with its default f16 KV cache (llama-bench offers no f32 one; this engine's
rows are f32), so the comparison leans its way. Optional: it needs a built llama.cpp and the model
in GGUF.

    # once: llama.cpp's source (vendored by llama-cpp-python) and its two benchmark tools
    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \\
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench llama-batched-bench
    # once: convert (a Python with transformers 4.57.x, numpy, sentencepiece and llama.cpp's gguf-py)
    python benchmarks/llamacpp_convert.py LLAMA_CPP_DIR irminsul/bundled/mla mla-f32.gguf
    python benchmarks/bench_llamacpp.py --llama-cpp LLAMA_CPP_DIR --gguf mla-f32.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from irminsul import LLM, bundled_model
from irminsul.cli import run_for_people
from irminsul.errors import UserFacingError
from irminsul.machine import best_of, describe

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import engine_prefill_decode  # noqa: E402  (a sibling script)

SHAPES = {"one": (1, 100, 64), "batch32": (32, 100, 64)}


def _tool(llama: Path, name: str) -> Path:
    path = llama / "build" / "bin" / name
    if not path.exists():
        raise UserFacingError(f"{path} is missing: build llama.cpp's {name} first (see this script's docstring)")
    return path


def llamacpp(llama: Path, gguf: Path, depth: int, new: int, threads: int) -> dict[str, float]:
    """tokens/s per case, the better of flash attention off and on."""
    out: dict[str, float] = {}
    for fa in ("0", "1"):
        for b, p, g in SHAPES.values():
            text = subprocess.run(
                [
                    str(_tool(llama, "llama-batched-bench")),
                    "-m",
                    str(gguf),
                    "-t",
                    str(threads),
                    "-c",
                    "8192",
                    "-b",
                    "2048",
                    "-ub",
                    "512",
                    "-npp",
                    str(p),
                    "-ntg",
                    str(g),
                    "-npl",
                    str(b),
                    "-fa",
                    "on" if fa == "1" else "off",
                    "--output-format",
                    "jsonl",
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            row = [json.loads(line) for line in text.splitlines() if line.startswith("{")][-1]
            key = "one" if b == 1 else "batch32"
            out[key] = max(out.get(key, 0.0), row["speed"])
        for key, args in (
            ("prefill", ["-p", str(depth), "-n", "0"]),
            ("decode", ["-p", "0", "-n", str(new), "-d", str(depth)]),
        ):
            text = subprocess.run(
                [
                    str(_tool(llama, "llama-bench")),
                    "-m",
                    str(gguf),
                    "-t",
                    str(threads),
                    "-fa",
                    fa,
                    "-r",
                    "3",
                    "-o",
                    "json",
                    *args,
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            out[key] = max(out.get(key, 0.0), json.loads(text)[0]["avg_ts"])
    return out


def irminsul(llm: LLM, depth: int, new: int) -> dict[str, float]:
    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(0)
    out = {}
    for key, (b, p, g) in SHAPES.items():
        prompts = [rng.integers(10, vocab, p).tolist() for _ in range(b)]
        llm.generate(prompts, max_tokens=4, ignore_eos=True)  # warm-up
        out[key] = b * (p + g) / best_of(lambda: llm.generate(prompts, max_tokens=g, ignore_eos=True), 2)
    prefill, decode = engine_prefill_decode(llm, rng.integers(10, vocab, depth).tolist(), new)
    out["prefill"], out["decode"] = depth / prefill, new / decode
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True, help="a llama.cpp source tree with build/bin/llama-bench")
    ap.add_argument("--gguf", required=True, help="the same model in GGUF, f32 (see llamacpp_convert.py)")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled MLA model)")
    ap.add_argument("--depth", type=int, default=1500)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument(
        "--eager", action="store_true", help="LLM(compile_decode=False): no compiled decode steps (on by default)"
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="threads for both engines (torch's and llama.cpp's -t); 0: every core"
    )
    args = ap.parse_args()
    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)
    if not Path(args.gguf).exists():
        raise UserFacingError(f"{args.gguf} does not exist; convert the model first (llamacpp_convert.py)")
    model = Path(args.model) if args.model else bundled_model("mla")
    print(
        f"machine: {describe()}\nmodel: {model} (f32), llama.cpp {args.llama_cpp} with {args.gguf}, "
        f"{threads} thread(s) each\n"
    )
    theirs = llamacpp(Path(args.llama_cpp), Path(args.gguf), args.depth, args.new, threads)
    llm = LLM(model, compile_decode=False if args.eager else None)
    llm.wait_compiled()  # timed once the decode steps compiling in the background are ready
    ours = irminsul(llm, args.depth, args.new)
    shapes = {
        "one": "1 x (100 + 64)",
        "batch32": "32 x (100 + 64)",
        "prefill": f"{args.depth} tokens",
        "decode": f"{args.new} at depth {args.depth}",
    }
    print(f"{'case':8} {'shape':20} {'irminsul tok/s':>15} {'llama.cpp tok/s':>16} {'ratio':>7}")
    for key, shape in shapes.items():
        print(f"{key:8} {shape:20} {ours[key]:15.1f} {theirs[key]:16.1f} {ours[key] / theirs[key]:6.2f}x")


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
