"""vLLM alone against vLLM + Irminsul through the OpenAI server, with a registry smaller than the work.

Each server is started as docs/vllm.md says and asked through the `openai` client with token-id prompts,
one request at a time; one vLLM process runs at a time, with one thread (OMP_NUM_THREADS=1, and vLLM's
own core binding off: VLLM_CPU_OMP_THREADS_BIND=nobind):

- vLLM + Irminsul: `irminsul vllm-serve CKPT --kv-transfer-config '{"kv_connector_extra_config":
  {"registry_gib": ...}}'`, the registry sized to hold about `--registry-tokens` tokens' rows;
- vLLM alone: `python -m vllm.entrypoints.openai.api_server --model CKPT` with the same options but the
  connector and its scheduler (`--attention-backend CPU_MLA --no-async-scheduling
  --enable-prompt-tokens-details`, as `irminsul vllm-serve` fills them in).

On a 3-layer random DeepSeek-V3-shaped checkpoint (q_lora_rank set, DeepSeek-V3's YaRN rope scaling,
bf16), `--repeat` fresh documents per case, TTFT = the request's wall time with `max_tokens=1`:

  moved    a document seen behind header A (40 tokens), then asked behind header B (233 tokens:
           unaligned to blocks and chunks) with the same question;
  swapped  two documents after a header, then the same header with the two in the other order;
  new      the moved document followed by `--new-tokens` tokens never seen (computed after the
           loaded rows);

then, on the Irminsul server only, `--cycle` requests one at a time through more documents than the
registry holds (each document asked twice in a row behind new headers, then the next; `--cycle-docs`
documents in turn): every request must be answered, no planned row missed, and the connector's counters
(/metrics, read after each answer) show rows evicted all along.

On a 1-layer checkpoint of the same shape (where a moved row is exactly the row vLLM would compute), the
moved document's first `--logprob-tokens` generated tokens' log-probabilities (top 20) from vLLM +
Irminsul against vLLM alone's; and vLLM alone's own noise: its decode log-probabilities of those tokens
against its prefill scoring of the same tokens (`echo` with the continuation appended).

    # in the vLLM venv (docs/vllm.md); the checkpoints are built under --work if absent
    OMP_NUM_THREADS=1 python benchmarks/bench_vllm_serve.py

The checkpoints come from the project's maker (`irminsul.model.tiny.make_tiny_checkpoint`, what
`irminsul checkpoint random` calls, with the sizes of `random_config` plus q_lora_rank and the YaRN
scaling, which that command has no option for). Rows loaded are read from the server's log (the
connector's line per finished request) and checked against `usage.prompt_tokens_details.cached_tokens`
(vLLM's prefix cache is off for MLA on its CPU backend, so every cached token here is a loaded row).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the clone's root, for tests/support
from tests.support.services import free_port, stop_process  # noqa: E402

# `irminsul checkpoint random`'s options
SHAPE = dict(hidden=1024, heads=8, vocab=1024, experts=16, kv_lora_rank=512, rope_head_dim=64)
SHAPE.update(nope_head_dim=128, v_head_dim=128)
Q_LORA_RANK = 384
# DeepSeek-V3's own rope scaling (its config.json)
YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
CONTEXT = YARN["factor"] * YARN["original_max_position_embeddings"]
MAX_MODEL_LEN = 4096
HEADER_A, HEADER_B, DOC, QUESTION = 40, 233, 1467, 8
PAIR_HEADER, PAIR_DOC = 40, 700
CYCLE_HEADER, CYCLE_DOC = 40, 600
COUNTERS = ("loaded_rows", "saved_rows", "missed_rows", "evicted_rows")


# ------------------------------------------------------------------ checkpoints
def build_checkpoint(path: Path, layers: int) -> None:
    """A random DeepSeek-V3-shaped checkpoint: the maker's config for SHAPE, q_lora_rank and YaRN, bf16."""
    import torch
    from safetensors.torch import load_file, save_file

    from irminsul.model.random_checkpoint import random_config
    from irminsul.model.tiny import make_tiny_checkpoint

    opts = dict(family="deepseek_v3", layers=layers, context=CONTEXT, experts_per_token=None, shared_experts=None)
    config = random_config(argparse.Namespace(**SHAPE, **opts))
    config.update(q_lora_rank=Q_LORA_RANK, rope_scaling=dict(YARN))
    std = 0.1 * math.sqrt(64 / SHAPE["hidden"])  # (as `irminsul checkpoint random` draws them)
    make_tiny_checkpoint(path, "v3", std=std, **config)
    for f in path.glob("*.safetensors"):
        state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(f)).items()}
        save_file(state, str(f), metadata={"format": "pt"})
    print(f"built {path.name}: {layers} layers, {parameters(path) / 1e6:.1f} M parameters, bf16", flush=True)


def parameters(path: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n


def checkpoint(work: Path, layers: int) -> Path:
    path = work / f"v3-{layers}l"
    if not (path / "config.json").exists():
        build_checkpoint(path, layers)
    return path


def bytes_per_token(path: Path) -> int:
    """The connector's charge for one token's rows: every layer's kv_lora_rank + rope dims, bf16."""
    cfg = json.loads((path / "config.json").read_text())
    return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2


# ------------------------------------------------------------------ servers
def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


class Server:
    def __init__(self, process: subprocess.Popen, url: str, log: Path, started_s: float):
        self.process, self.url, self.log, self.started_s = process, url, log, started_s
        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=1800, max_retries=0)
        self.model = self.client.models.list().data[0].id

    def counters(self) -> dict[str, float]:
        text = _get(self.url + "/metrics")
        out = {}
        for name in COUNTERS:
            found = re.search(rf"^vllm:irminsul_{name}_total{{[^}}]*}} (\S+)$", text, re.M)
            out[name] = float(found.group(1)) if found else 0.0
        return out

    def request_lines(self) -> list[tuple[int, int, int]]:
        """The connector's line per finished request, in order: (prompt tokens, loaded, computed)."""
        found = re.findall(
            r"irminsul: request \S+: (\d+) prompt tokens, (\d+) loaded from the registry, (\d+) computed",
            self.log.read_text(errors="replace"),
        )
        return [(int(a), int(b), int(c)) for a, b, c in found]

    def complete(self, prompt: list[int], max_tokens: int = 1, **extra):
        t0 = time.perf_counter()
        out = self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra
        )
        return out, time.perf_counter() - t0


@contextmanager
def serve(mode: str, ckpt: Path, work: Path, dtype: str, registry_gib: float | None = None):
    port, log = free_port(), work / f"server-{mode}-{ckpt.name}.log"
    common = ["--port", str(port), "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN)]
    common += ["--enforce-eager", "--max-logprobs", "20", "--seed", "0"]
    if mode == "irminsul":
        irminsul = Path(sys.executable).with_name("irminsul")
        extra = json.dumps({"kv_connector_extra_config": {"registry_gib": registry_gib}})
        cmd = [str(irminsul), "vllm-serve", str(ckpt), *common, "--kv-transfer-config", extra]
    else:  # what `irminsul vllm-serve` fills in, but the connector and its scheduler (this module takes
        # the model as --model: a positional one is parsed and ignored)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), *common]
        cmd += ["--attention-backend", "CPU_MLA", "--no-async-scheduling", "--enable-prompt-tokens-details"]
    # one thread, and vLLM's own core binding off: it binds the worker to every core but the ones it
    # reserves, and it reserves one more where a KV connector is configured
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}
    t0 = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the {mode} server exited ({process.returncode}):\n{log.read_text()[-4000:]}")
            try:
                _get(url + "/health")
                break
            except OSError:
                if time.perf_counter() - t0 > 900:
                    raise SystemExit(f"the {mode} server did not start in 900 s:\n{log.read_text()[-4000:]}") from None
                time.sleep(1)
        yield Server(process, url, log, time.perf_counter() - t0)
    finally:
        stop_process(process, 60)


def peak_rss_gib(pid: int) -> float:
    """The largest peak RSS among the server's processes (the engine's, which holds the model)."""

    def tree(p: int) -> list[int]:
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
            kids = [int(c) for t in tasks for c in (t / "children").read_text().split()]
        except OSError:
            kids = []
        return [p, *(q for k in kids for q in tree(k))]

    peaks = []
    for p in tree(pid):
        try:
            found = re.search(r"^VmHWM:\s+(\d+) kB", Path(f"/proc/{p}/status").read_text(), re.M)
        except OSError:
            continue
        if found:
            peaks.append(int(found.group(1)) / 2**20)
    return max(peaks, default=float("nan"))


def thread_binding(log: Path) -> str:
    """vLLM's own lines on its worker's OpenMP threads: the binding asked for and the cores bound."""
    text = log.read_text(errors="replace")
    asked = re.search(r"VLLM_CPU_OMP_THREADS_BIND=('[^']*')", text)
    cores = re.search(r"local_rank=0, core ids=(\[[^\]]*\])", text)
    return f"VLLM_CPU_OMP_THREADS_BIND={asked.group(1) if asked else '?'}" + (
        f", cores {cores.group(1)}" if cores else ""
    )


# ------------------------------------------------------------------ prompts
def ids(rng, n: int) -> list[int]:
    return rng.integers(0, 256, n).tolist()  # (the byte tokens every random checkpoint has)


def case_prompts(case: str, seed: int, new_tokens: int) -> tuple[list[int], list[int], int]:
    """(the request that stores, the timed request, how many of the timed one's tokens the first had:
    what it could load)."""
    rng = np.random.default_rng(1000 * seed + {"moved": 1, "swapped": 2, "new": 3}[case])
    if case == "swapped":
        header, a, b, q = ids(rng, PAIR_HEADER), ids(rng, PAIR_DOC), ids(rng, PAIR_DOC), ids(rng, QUESTION)
        return header + a + b + q, header + b + a + q, PAIR_HEADER + 2 * PAIR_DOC + QUESTION
    ha, hb, doc, q = ids(rng, HEADER_A), ids(rng, HEADER_B), ids(rng, DOC), ids(rng, QUESTION)
    if case == "moved":
        return ha + doc + q, hb + doc + q, DOC + QUESTION
    return ha + doc + q, hb + doc + ids(rng, new_tokens), DOC


# ------------------------------------------------------------------ runs
def run_cases(server: Server, mode: str, repeat: int, new_tokens: int) -> dict:
    server.complete(list(range(1, 65)))  # warm-up: one-time costs, not measured
    out: dict[str, list[dict]] = {}
    for case in ("moved", "swapped", "new"):
        out[case] = []
        for seed in range(repeat):
            first, timed, doc = case_prompts(case, seed, new_tokens)
            server.complete(first)
            answer, seconds = server.complete(timed)
            details = answer.usage.prompt_tokens_details
            out[case].append(
                {
                    "ttft": seconds,
                    "prompt": answer.usage.prompt_tokens,
                    "repeated": doc,
                    "cached": (details.cached_tokens or 0) if details else 0,
                }
            )
            print(f"  {mode} {case} {seed}: {seconds:.3f} s, cached {out[case][-1]['cached']}", flush=True)
    if mode == "irminsul":  # the connector's own counts: each case's timed request is its second line
        lines = server.request_lines()[1:]  # (after the warm-up)
        for i, runs in enumerate(out.values()):
            for j, run in enumerate(runs):
                prompt, loaded, computed = lines[2 * (i * repeat + j) + 1]
                assert prompt == run["prompt"], (prompt, run)
                run.update(loaded=loaded, computed=computed)
    return out


def run_cycle(server: Server, requests: int, docs: int) -> dict:
    """`requests` one at a time: document (i // 2) % docs behind a new header each time; the connector's
    counters read after each answer."""
    rng = np.random.default_rng(7)
    bodies = [ids(rng, CYCLE_DOC) for _ in range(docs)]
    lines_before, last = len(server.request_lines()), server.counters()
    answered, errors, steps, t0 = 0, [], [], time.perf_counter()
    for i in range(requests):
        prompt = ids(rng, CYCLE_HEADER + i % 7) + bodies[i // 2 % docs] + ids(rng, QUESTION)
        try:
            answer, _ = server.complete(prompt)
            answered += answer.usage.completion_tokens == 1
        except Exception as e:  # noqa: BLE001 (counted and shown: the target is none)
            errors.append(repr(e)[:200])
        now = server.counters()
        steps.append({k: now[k] - last[k] for k in COUNTERS})
        last = now
    seconds = time.perf_counter() - t0
    lines = server.request_lines()[lines_before:]
    return {
        "requests": requests,
        "answered": answered,
        "errors": errors,
        "seconds": seconds,
        "per_request": steps,
        "counters": {k: sum(x[k] for x in steps) for k in COUNTERS},
        "prompt_tokens": sum(x[0] for x in lines),
    }


def top_logprobs(choice) -> list[dict[int, float]]:
    """Per generated token: token id -> log-probability (return_tokens_as_token_ids: "token_id:N")."""
    return [
        {int(k.split(":", 1)[1]): v for k, v in (step or {}).items()}  # (echo: the first prompt token's is None)
        for step in choice.logprobs.top_logprobs
    ]


def _max_diff(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
    return max(abs(a[i][t] - b[i][t]) for i in range(min(len(a), len(b))) for t in a[i] if t in b[i])


def run_logprobs(server: Server, mode: str, repeat: int, n: int) -> list[dict]:
    server.complete(list(range(1, 65)))
    out = []
    extra = dict(logprobs=20, extra_body={"return_tokens_as_token_ids": True})
    for seed in range(repeat):
        first, moved, _ = case_prompts("moved", seed, 0)
        server.complete(first)
        answer, _ = server.complete(moved, max_tokens=n, **extra)
        choice = answer.choices[0]
        tokens = [int(t.split(":", 1)[1]) for t in choice.logprobs.tokens]
        run = {
            "tokens": tokens,
            "decode": top_logprobs(choice),
            "cached": answer.usage.prompt_tokens_details.cached_tokens,
        }
        if mode == "alone":  # its prefill scoring of the same tokens: the continuation appended, echoed
            scored, _ = server.complete(moved + tokens, max_tokens=1, echo=True, **extra)
            run["prefill"] = top_logprobs(scored.choices[0])[len(moved) : len(moved) + n]
        out.append(run)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/irminsul-bench-vllm-serve", help="checkpoints and server logs")
    p.add_argument("--repeat", type=int, default=3, help="fresh documents per case")
    p.add_argument("--new-tokens", type=int, default=300, help="the `new` case: tokens after the moved document")
    p.add_argument("--registry-tokens", type=int, default=2400, help="the registry's size, in tokens' rows")
    p.add_argument("--cycle", type=int, default=100, help="requests through more documents than the registry holds")
    p.add_argument("--cycle-docs", type=int, default=8)
    p.add_argument("--logprob-tokens", type=int, default=4)
    p.add_argument("--parts", default="speed,exact", help="speed (3 layers), exact (1 layer), or both")
    p.add_argument("--json", help="write every measurement here")
    args = p.parse_args(argv)
    t_run = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    import vllm

    from irminsul.machine import describe

    print(f"machine: {describe()}\nvllm {vllm.__version__}; servers: OMP_NUM_THREADS=1, one at a time", flush=True)
    result: dict = {}
    if "speed" in args.parts:
        ck = checkpoint(work, 3)
        registry_gib = args.registry_tokens * bytes_per_token(ck) / 2**30
        speed: dict = {}
        for mode in ("alone", "irminsul"):
            with serve(mode, ck, work, "bfloat16", registry_gib) as server:
                speed[mode] = {"start_s": server.started_s, "binding": thread_binding(server.log)}
                speed[mode]["cases"] = run_cases(server, mode, args.repeat, args.new_tokens)
                if mode == "irminsul":
                    speed["cycle"] = run_cycle(server, args.cycle, args.cycle_docs)
                speed[mode]["peak_rss_gib"] = peak_rss_gib(server.process.pid)
        result["speed"] = speed
        report_speed(ck, speed, args)
    if "exact" in args.parts:
        ck = checkpoint(work, 1)
        registry_gib = args.registry_tokens * bytes_per_token(ck) / 2**30
        exact = {}
        for mode in ("alone", "irminsul"):
            with serve(mode, ck, work, "bfloat16", registry_gib) as server:
                exact[mode] = run_logprobs(server, mode, args.repeat, args.logprob_tokens)
        result["exact"] = exact
        report_exact(ck, exact, args)
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    print(f"\nthe whole run: {time.perf_counter() - t_run:.0f} s")
    return 0


def _median(xs: list[float]) -> float:
    return float(np.median(np.asarray(xs)))


def report_speed(ck: Path, speed: dict, args) -> None:
    cfg = json.loads((ck / "config.json").read_text())
    print(
        f"\ncheckpoint: random DeepSeek-V3 shape, {parameters(ck) / 1e6:.1f} M parameters, "
        f"{cfg['num_hidden_layers']} layers (the first dense), hidden "
        f"{cfg['hidden_size']}, {cfg['num_attention_heads']} heads, q_lora {cfg['q_lora_rank']}, kv_lora "
        f"{cfg['kv_lora_rank']} + rope {cfg['qk_rope_head_dim']} (YaRN x{cfg['rope_scaling']['factor']}), nope "
        f"{cfg['qk_nope_head_dim']}, v {cfg['v_head_dim']}, {cfg['n_routed_experts']} experts top-"
        f"{cfg['num_experts_per_tok']}, vocab {cfg['vocab_size']}, bf16; registry {args.registry_tokens} tokens' "
        f"rows ({args.registry_tokens * bytes_per_token(ck) / 2**20:.1f} MiB)"
    )
    for mode in ("alone", "irminsul"):
        s = speed[mode]
        print(f"{mode}: server up in {s['start_s']:.0f} s, {s['binding']}, peak RSS {s['peak_rss_gib']:.2f} GiB")
    names = {
        "moved": f"moved document (header {HEADER_A} -> {HEADER_B}, document {DOC}, question {QUESTION})",
        "swapped": f"swapped pair (header {PAIR_HEADER}, documents {PAIR_DOC} + {PAIR_DOC}, question {QUESTION})",
        "new": f"moved + new text (header {HEADER_A} -> {HEADER_B}, document {DOC}, then {args.new_tokens} new)",
    }
    print(
        f"\nTTFT through the OpenAI server (max_tokens=1, one request at a time), median of {args.repeat} fresh "
        "documents; rows loaded: of the prompt's tokens the first request had (the connector's log line; "
        "cached_tokens: the answers' usage.prompt_tokens_details)\n"
    )
    print(
        "| case | prompt | vLLM alone | vLLM + Irminsul | ratio | rows loaded / repeated | computed | cached_tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for case, name in names.items():
        a, b = speed["alone"]["cases"][case], speed["irminsul"]["cases"][case]
        ta, tb = _median([x["ttft"] for x in a]), _median([x["ttft"] for x in b])
        cached_ok = all(x["cached"] == x["loaded"] for x in b) and all(x["cached"] == 0 for x in a)
        print(
            f"| {name} | {b[0]['prompt']} | {ta:.3f} s | {tb:.3f} s | {ta / tb:.2f}x | "
            f"{_span([x['loaded'] for x in b])} / {b[0]['repeated']} ({_span([x['loaded'] / x['repeated'] for x in b], '{:.0%}')}) | "
            f"{_span([x['computed'] for x in b])} | {'= rows loaded; 0 alone' if cached_ok else 'DIFFERS'} |"
        )
    moved_a = _median([x["ttft"] for x in speed["alone"]["cases"]["moved"]])
    moved_b = _median([x["ttft"] for x in speed["irminsul"]["cases"]["moved"]])
    share = min(x["loaded"] / x["repeated"] for x in speed["irminsul"]["cases"]["moved"])
    for case in names:
        per_run = ", ".join(
            f"{x['ttft']:.3f} / {y['ttft']:.3f}"
            for x, y in zip(speed["alone"]["cases"][case], speed["irminsul"]["cases"][case])
        )
        print(f"{case}: TTFT per document, alone / + Irminsul (s): {per_run}")
    print(
        f"target: TTFT >= 4x lower on the moved document: {moved_a / moved_b:.2f}x, "
        f"{'met' if moved_a / moved_b >= 4 else 'NOT met'}; >= 70% of its rows loaded: at least {share:.0%}, "
        f"{'met' if share >= 0.7 else 'NOT met'}"
    )
    c = speed["cycle"]
    capacity, steps = args.registry_tokens, c["per_request"]
    evicting = [i for i, x in enumerate(steps) if x["evicted_rows"] > 0]
    gaps = np.diff(evicting) if len(evicting) > 1 else np.asarray([0])
    n = c["counters"]
    print(
        f"\nregistry below the working set: {c['requests']} requests, one at a time, through {args.cycle_docs} "
        f"documents of {CYCLE_DOC} tokens ({args.cycle_docs * CYCLE_DOC} tokens; each asked twice in a row behind "
        f"new headers of {CYCLE_HEADER}-{CYCLE_HEADER + 6} tokens, then the next) with a registry of {capacity} "
        f"tokens' rows\n"
        f"  answered {c['answered']}/{c['requests']}, errors {len(c['errors'])}, missed rows {int(n['missed_rows'])}; "
        f"rows saved {int(n['saved_rows'])}, evicted {int(n['evicted_rows'])} (in {len(evicting)} of the "
        f"requests, at most {int(gaps.max())} apart), loaded {int(n['loaded_rows'])} (in "
        f"{sum(x['loaded_rows'] > 0 for x in steps)} requests); {c['seconds']:.1f} s, "
        f"{c['prompt_tokens'] / c['seconds']:.0f} prompt tokens/s"
    )
    ok = c["answered"] == c["requests"] and not c["errors"] and n["missed_rows"] == 0 and len(evicting) > 0
    print(f"target: every request answered through evictions, no error: {'met' if ok else 'NOT met'}")
    for e in c["errors"][:3]:
        print("  error:", e)


def _span(xs: list, fmt: str = "{}") -> str:
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def report_exact(ck: Path, exact: dict, args) -> None:
    n = args.logprob_tokens
    print(
        f"\none layer ({ck.name}, same shape, {parameters(ck) / 1e6:.1f} M parameters, bf16): the moved "
        f"document's first {n} generated tokens' "
        "log-probabilities (top 20), max |difference| per document"
    )
    print(
        "| document | continuation equal | vLLM + Irminsul vs vLLM alone | vLLM alone: decode vs its prefill | rows loaded |"
    )
    print("|---:|---|---:|---:|---:|")
    worst, noise = 0.0, 0.0
    for i, (a, b) in enumerate(zip(exact["alone"], exact["irminsul"])):
        same = a["tokens"] == b["tokens"]
        k = n if same else next(j for j in range(n) if a["tokens"][j] != b["tokens"][j]) + 1
        d = _max_diff(b["decode"][:k], a["decode"][:k])
        own = _max_diff(a["decode"], a["prefill"])
        worst, noise = max(worst, d), max(noise, own)
        print(f"| {i} | {same} | {d:.3f} | {own:.3f} | {b['cached']} |")
    print(
        f"target within 0.15 of vLLM alone: {worst:.3f} {'met' if worst <= 0.15 else 'NOT met'} (vLLM alone's own "
        f"decode-vs-prefill noise on the same tokens: {noise:.3f})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
