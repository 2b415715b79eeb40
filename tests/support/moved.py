"""The moved document, run in vLLM alone, in vLLM + Irminsul, and in Irminsul's own engine.

A document seen once behind one header comes back behind another (the paper's case). The
helpers here build the prompts, run them in an in-process vLLM engine and read back the first
generated tokens' log-probabilities, the wall time of the moved request (one token: its TTFT) and
the connector's counts. Shared by tests/integrations and benchmarks (bench_vllm.py, bench_moved.py,
bench_real_shapes.py); test support, not part of the installed package.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np


@dataclass
class MovedPrompts:
    first: list[int]  # header A + document + question
    moved: list[int]  # header B + document + question
    doc_start: int  # where the document starts in `moved`
    doc_len: int


def moved_prompts(
    header_a: int = 40,
    header_b: int = 75,
    doc: int = 600,
    question: int = 8,
    seed: int = 0,
    vocab: int = 256,
    new_question: int = 0,
) -> MovedPrompts:
    """Random byte-token prompts (ids < vocab: the random checkpoints' byte tokens). `new_question`
    tokens, never seen before, end the moved prompt (computed after the loaded rows)."""
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(0, vocab, n).tolist()  # noqa: E731
    ha, hb, d, q = ids(header_a), ids(header_b), ids(doc), ids(question)
    extra = ids(new_question) if new_question else []
    return MovedPrompts(ha + d + q, hb + d + q + extra, header_b, doc)


@dataclass
class VllmRun:
    logprobs: list[dict[int, float]]  # per generated token: token id -> log-probability (top-k)
    token_ids: list[int]
    seconds: float  # wall time of the moved request
    stats: object | None  # the connector's RequestStats of the moved request (with Irminsul)
    worker_loaded_rows: int = 0
    num_cached_tokens: int = 0  # vLLM's own count for the moved request (RequestOutput.num_cached_tokens)


def make_vllm(
    path: str,
    irminsul: bool,
    dtype: str = "float32",
    max_model_len: int = 4096,
    connector_extra: dict | None = None,
    **extra,
):
    """An in-process vLLM engine, with Irminsul's connector and scheduler when `irminsul`
    (`connector_extra`: its kv_connector_extra_config)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: counters readable
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for these prompts
    from vllm import LLM
    from vllm.platforms import current_platform

    options = {}
    if current_platform.is_cpu():
        # vLLM's reference CPU MLA backend: on a CPU with AMX vLLM picks its AMX MLA backend instead,
        # which takes bf16 weights only (an fp32 model fails at load: "expect weight to be bfloat16,
        # ...") and keeps its cache its own way; the connector reads and writes the reference one
        options["attention_backend"] = "CPU_MLA"
    if irminsul:
        from vllm.config import KVTransferConfig

        from irminsul.integrations.vllm import CONNECTOR, SCHEDULER

        transfer = KVTransferConfig(**CONNECTOR, kv_connector_extra_config=connector_extra or {})
        options.update(kv_transfer_config=transfer, scheduler_cls=SCHEDULER)
    return LLM(
        path,
        dtype=dtype,
        max_model_len=max_model_len,
        enforce_eager=True,
        max_num_seqs=4,
        async_scheduling=False,
        max_logprobs=20,
        seed=0,
        gpu_memory_utilization=0.15,
        **options,
        **extra,
    )


def run_vllm(llm, prompts: MovedPrompts, max_tokens: int = 4, logprobs: int = 20, warm: bool = True) -> VllmRun:
    from vllm import SamplingParams

    from irminsul.integrations.vllm.connector import INSTANCES

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True)
    if warm:  # the first request pays one-time costs (kernels, allocations); not what is measured
        llm.generate([{"prompt_token_ids": list(range(1, 65))}], params, use_tqdm=False)
    llm.generate([{"prompt_token_ids": prompts.first}], params, use_tqdm=False)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    timed = llm.generate([{"prompt_token_ids": prompts.moved}], one, use_tqdm=False)
    seconds = time.perf_counter() - t0
    sched = INSTANCES["scheduler"][-1] if INSTANCES["scheduler"] else None
    stats = None
    if sched is not None:  # (the engine's own id carries a suffix after the caller's: "2-a9a8ecad")
        stats = next((v for k, v in sched.stats.items() if k.split("-")[0] == timed[0].request_id), None)
    out = llm.generate([{"prompt_token_ids": prompts.moved}], params, use_tqdm=False)[0].outputs[0]
    lps = [{tid: lp.logprob for tid, lp in step.items()} for step in out.logprobs]
    worker = INSTANCES["worker"][-1].loaded_rows if INSTANCES["worker"] else 0
    return VllmRun(lps, list(out.token_ids), seconds, stats, worker, timed[0].num_cached_tokens or 0)


def irminsul_logprobs(path: str, prompts: MovedPrompts, continuation: list[int], reuse: str = "pic"):
    """Irminsul's own engine: the first prompt, then the moved one scored on `continuation`."""
    from irminsul import LLM

    llm = LLM(path, reuse=reuse, compile_decode=False)
    llm.generate([prompts.first], max_tokens=1)
    lp = llm.score(prompts.moved, continuation)
    return lp, llm.last_stats


def main(argv=None) -> int:
    """`python -m tests.support.moved CKPT --mode alone|irminsul` (from the clone's root): one engine, one JSON line."""
    import argparse
    import dataclasses
    import json

    import torch

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("checkpoint")
    p.add_argument("--mode", choices=["alone", "irminsul"], required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--header-a", type=int, default=40)
    p.add_argument("--header-b", type=int, default=75)
    p.add_argument("--doc", type=int, default=600)
    p.add_argument("--question", type=int, default=8)
    p.add_argument("--new-question", type=int, default=0, help="new tokens after the moved document's question")
    p.add_argument("--repeat", type=int, default=1, help="time the moved request this many times (fresh documents)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    llm = make_vllm(args.checkpoint, irminsul=args.mode == "irminsul", dtype=args.dtype)
    runs = []
    for i in range(args.repeat):
        prompts = moved_prompts(
            args.header_a, args.header_b, args.doc, args.question, seed=i, new_question=args.new_question
        )
        r = run_vllm(llm, prompts, warm=i == 0)
        runs.append(
            {
                "token_ids": r.token_ids,
                "seconds": r.seconds,
                "logprobs": [{str(k): v for k, v in step.items()} for step in r.logprobs],
                "stats": dataclasses.asdict(r.stats) if r.stats is not None else None,
                "num_cached_tokens": r.num_cached_tokens,
            }
        )
    print("RESULT " + json.dumps({"mode": args.mode, "runs": runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
