"""The GPU check: the engine with the triton backend on random weights in DeepSeek-V2-Lite's
shapes, every figure a ratio against a peer measured in the same run.

    bash benchmarks/gpu_check.sh                  # on a GPU machine: the kernel tests on CUDA, then this
    python benchmarks/gpu_check.py --tiny         # the same code path on tiny shapes (CPU, TRITON_INTERPRET=1)

1. decode throughput at 1 / 32 / 128 concurrent requests (100-token prompts, 64 new tokens, greedy):
   `LLM.generate(list)` with the triton backend against transformers' `generate` on the same weights
   and token ids (left-padded batch), and the engine's decode steps captured as CUDA graphs
   (model/graphs.py) against the same engine's eager steps;
2. TTFT of agent_meta-style requests (a varying header in front of one shared document, tau-bench's
   airline policy, then a question): `pic` against `prefix`, next to the ideal ratio computed /
   prompt tokens; and prefill energy per request from NVML's energy counter (the paper's headline:
   63% saved for MLA), `pic` against `prefix`;
3. RoPE-at-read throughput (what replaced rotating rows at admission): encoding k_r of 64k keys, GB/s.

Random weights mean random text: what is measured is speed and energy, never answers. The weights
are made on the device (bf16), not loaded, so the check fits in minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from irminsul.data import data_file
from irminsul.engine.build import build_engine
from irminsul.engine.config import EngineConfig
from irminsul.engine.engine import Engine
from irminsul.engine.sampling import SamplingParams
from irminsul.machine import describe
from irminsul.model.config import ModelConfig
from irminsul.model.deepseek import DeepseekModel
from irminsul.model.rope import Rotary
from irminsul.model.tiny import BASE, VARIANTS, YARN, write_tokenizer
from irminsul.model.tokenizer import Tokenizer

# DeepSeek-V2-Lite (15.7 B parameters, 2.4 B active), from its published config.json
V2_LITE = dict(
    BASE,
    **VARIANTS["v2"],
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=163840,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    bos_token_id=100000,
    eos_token_id=100001,
    n_group=1,
    topk_group=1,
    rope_scaling=dict(YARN, factor=40.0, original_max_position_embeddings=4096),
)
TINY = dict(BASE, **VARIANTS["v2"], rope_scaling=dict(YARN))


def gpu_name() -> str:
    if not torch.cuda.is_available():
        return "no GPU (tiny mode: CPU, Triton's interpreter)"
    p = torch.cuda.get_device_properties(0)
    return f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, torch {torch.__version__}"


class Energy:
    """Joules from NVML's total-energy counter (millijoules since the driver loaded); None without NVML."""

    def __init__(self):
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception:  # no GPU, no NVML, or a GPU without the counter
            self.handle = None

    def read(self) -> float | None:
        if self.handle is None:
            return None
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(
    raw: dict,
    device: str,
    dtype: torch.dtype,
    backend: str,
    reuse: str,
    kv_gib: float,
    weights_of: Engine | None = None,
    compile_decode: bool | None = None,
) -> Engine:
    """An engine over random weights made on the device (nn.Linear's own initialisation), or over
    `weights_of`'s weights and pool (the same tensors: one copy on the device for both engines).
    compile_decode: decode steps as CUDA graphs (None: on a GPU; True in tiny mode: the uncaptured
    static step, so the same code runs)."""
    folder = Path(tempfile.mkdtemp(prefix="irminsul-gpu-check-"))
    (folder / "config.json").write_text(json.dumps(raw))
    write_tokenizer(folder, raw["vocab_size"])
    cfg = ModelConfig.from_dict(raw)
    rotary = Rotary(cfg.rope, device)  # outside the device context: it holds real buffers
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta" if weights_of is not None else device):
            model = DeepseekModel(cfg, rotary)
    finally:
        torch.set_default_dtype(default)
    model.eval().requires_grad_(False)  # (before assigning: the stacked experts are inference tensors)
    if weights_of is not None:
        model.load_state_dict(weights_of.model.state_dict(), assign=True)
    model.set_attention_backend(backend)
    return build_engine(
        EngineConfig.of(reuse=reuse, kv_cache_gib=kv_gib, compile_decode=compile_decode),
        model,
        Tokenizer(folder),
        pool=weights_of.pool if weights_of is not None else None,
    )


def generate(engine: Engine, prompts: list[list[int]], new: int) -> float:
    """Seconds for the scheduler to run every prompt to `new` tokens, all admitted together."""
    assert len(prompts) <= engine.scheduler.max_running_requests  # all admitted together
    for p in prompts:
        engine.add_request(engine.new_sequence(p, SamplingParams(max_tokens=new, ignore_eos=True)))
    sync()
    t = time.perf_counter()
    while engine.has_work:
        engine.step()
    sync()
    return time.perf_counter() - t


def hf_generate(model, prompts: list[list[int]], new: int) -> float:
    pad = 0
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    sync()
    t = time.perf_counter()
    model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad
    )
    sync()
    return time.perf_counter() - t


def transformers_twin(engine: Engine, raw: dict, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**raw)
    with torch.device(engine.model.device):  # (its own random weights are dropped just below)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.requires_grad_(False)
    model.load_state_dict(engine.model.state_dict(), strict=False, assign=True)  # the same tensors
    return model.eval()


def agent_meta(n: int, vocab: int, seed: int, body_tokens: int) -> list[list[int]]:
    """Byte-level token ids (the check's tokenizer): header + the shared policy text + a question."""
    rng = np.random.default_rng(seed)
    body = list(data_file("tau_bench", "airline_wiki.md").read_bytes()[:body_tokens])
    out = []
    for i in range(n):
        header = f"request_id={rng.integers(1e9)} agent=support " + " ".join(
            f"pref{int(x)}" for x in rng.integers(0, 1000, int(rng.integers(1, 60)))
        )
        question = f"\nQuestion {i}: can reservation {rng.integers(1e5)} be changed?"
        out.append(list(header.encode()) + body + list(question.encode()))
    return [[t % vocab for t in p] for p in out]


def ttft(engine: Engine, tokens: list[int], energy: Energy) -> tuple[float, float | None, object]:
    sync()
    e0, t = energy.read(), time.perf_counter()
    seq = engine.add(tokens, SamplingParams(max_tokens=1))
    while not seq.finished:
        engine.execute([seq])
    sync()
    elapsed, e1 = time.perf_counter() - t, energy.read()
    engine.finish(seq)
    return elapsed, (e1 - e0) if e0 is not None else None, seq.stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (checks the script, not the GPU)")
    ap.add_argument("--out", default="runs/gpu-check")
    ap.add_argument("--requests", type=int, default=16, help="agent_meta requests per mode")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    args = ap.parse_args()
    tiny = args.tiny or not torch.cuda.is_available()
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    raw = TINY if tiny else V2_LITE
    concurrency, new, prompt_len = ((1, 4, 8), 8, 24) if tiny else ((1, 32, 128), 64, 100)
    kv_gib = 0.25 if tiny else 40.0
    print(
        f"machine: {describe()}\ngpu: {gpu_name()}\nshapes: {'tiny' if tiny else 'DeepSeek-V2-Lite'} "
        f"(random weights, {dtype})",
        flush=True,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"machine": describe(), "gpu": gpu_name(), "tiny": tiny}

    t0 = time.perf_counter()
    engine = build(raw, device, dtype, "triton", "off", kv_gib, compile_decode=True)
    params = sum(p.numel() for p in engine.model.parameters())
    print(
        f"built {params / 1e9:.2f} B parameters and captured {len(engine.runner.graphs.graphs)} decode graphs in "
        f"{time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    eager = build(raw, device, dtype, "triton", "off", kv_gib, weights_of=engine, compile_decode=False)
    res["parameters"] = params
    vocab = raw["vocab_size"]
    rng = np.random.default_rng(0)

    # 1. decode throughput against transformers, and the captured steps against eager ones
    hf = None if args.no_transformers else transformers_twin(engine, raw, dtype)
    res["decode"] = []
    for c in concurrency:
        prompts = [rng.integers(300, vocab, prompt_len).tolist() for _ in range(c)]
        generate(engine, prompts[:1], 2)  # warm-up: compiles the kernels
        ours = c * new / generate(engine, prompts, new)
        generate(eager, prompts[:1], 2)
        uncaptured = c * new / generate(eager, prompts, new)
        row = {
            "concurrency": c,
            "irminsul_tok_s": ours,
            "eager_tok_s": uncaptured,
            "graphs_vs_eager": ours / uncaptured,
        }
        if hf is not None:
            hf_generate(hf, prompts[:1], 2)
            theirs = c * new / hf_generate(hf, prompts, new)
            row.update(transformers_tok_s=theirs, ratio=ours / theirs)
        res["decode"].append(row)
        print(
            f"decode, {c:>3} concurrent: irminsul {ours:,.0f} tok/s ({ours / uncaptured:.2f}x its eager steps)"
            + (f", transformers {row['transformers_tok_s']:,.0f} tok/s: {row['ratio']:.2f}x" if hf else ""),
            flush=True,
        )
    del hf, eager
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    # 2. agent_meta TTFT and prefill energy, pic against prefix (each engine its own pool and cache)
    body = 600 if tiny else 1600
    requests = agent_meta(args.requests + 1, vocab, 1, body)
    energy = Energy()
    modes = {}
    for mode in ("prefix", "pic"):
        e = build(raw, device, dtype, "triton", mode, kv_gib, weights_of=engine, compile_decode=False)
        ttft(e, requests[0], energy)  # the first request fills the cache
        runs = [ttft(e, r, energy) for r in requests[1:]]
        modes[mode] = runs
        del e
    t = {m: statistics.median(r[0] for r in runs) for m, runs in modes.items()}
    st = [r[2] for r in modes["pic"]]
    ideal = sum(s.computed_tokens for s in st) / sum(s.prompt_tokens for s in st)
    res["ttft"] = {"prefix_s": t["prefix"], "pic_s": t["pic"], "ratio": t["pic"] / t["prefix"], "ideal": ideal}
    print(
        f"agent_meta TTFT (median of {args.requests}): prefix {t['prefix'] * 1e3:.1f} ms, pic {t['pic'] * 1e3:.1f} ms,"
        f" pic/prefix {t['pic'] / t['prefix']:.3f} (ideal computed/prompt {ideal:.3f})",
        flush=True,
    )
    if energy.handle is not None:
        j = {m: statistics.median(r[1] for r in runs) for m, runs in modes.items()}
        res["energy"] = {"prefix_j": j["prefix"], "pic_j": j["pic"], "saved": 1 - j["pic"] / j["prefix"]}
        print(
            f"prefill energy per request: prefix {j['prefix']:.2f} J, pic {j['pic']:.2f} J: "
            f"{1 - j['pic'] / j['prefix']:.0%} saved (the paper: 63% for MLA)",
            flush=True,
        )
    else:
        print("prefill energy: NVML's energy counter is not available here", flush=True)

    # 3. RoPE at read
    cfg, rot = engine.model.config, engine.model.rotary
    n = 65536 if not tiny else 4096
    k_r = torch.randn(n, cfg.qk_rope_head_dim, device=device, dtype=dtype)
    cos, sin = rot.table(n, device)
    for _ in range(3):
        rot.encode_cached(k_r, cos[:n], sin[:n])
    sync()
    t1 = time.perf_counter()
    for _ in range(20):
        rot.encode_cached(k_r, cos[:n], sin[:n])
    sync()
    gbs = 20 * 2 * k_r.numel() * k_r.element_size() / (time.perf_counter() - t1) / 1e9
    res["rope_at_read_gb_s"] = gbs
    print(f"RoPE at read: {gbs:.1f} GB/s over {n:,} keys (read + write)", flush=True)
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / 'gpu_check.json'}")


if __name__ == "__main__":
    main()
