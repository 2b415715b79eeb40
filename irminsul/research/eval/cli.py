"""`irminsul eval quality|rotation|roc|cost`: the fidelity and cost evaluations.

Each prints a table (or, with --json, one JSON object), writes <out>/<name>.{json,md,png} with the
command, seed and model recorded, and shows progress on stderr.
"""

from __future__ import annotations

import time
from pathlib import Path

from irminsul.cli import at_least


def _common(p, n: int) -> None:
    p.add_argument("--n", type=at_least(1), default=n, help=f"number of samples (default {n})")
    p.add_argument("--model", default=None, help="MLA checkpoint directory (default: the bundled MLA model)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", default="runs/eval", help="folder for <name>.json/.md/.png (default runs/eval)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled items")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="fidelity and cost evaluations of position-independent reuse")
    sub = p.add_subparsers(dest="eval_command", required=True)

    q = sub.add_parser("quality", help="KL, agreement, divergence and accuracy of each reuse strategy")
    _common(q, 24)
    q.add_argument("--tasks", default="niah,musique,agent_meta", help="comma-separated tasks")
    q.add_argument("--strategies", default=None, help="comma-separated subset (default: all seven)")
    q.add_argument("--greedy-tokens", type=int, default=16, help="length of the greedy first-divergence probe")
    q.add_argument("--context", type=int, default=None, help="size tasks for this many tokens (default: model's)")
    q.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype")
    q.add_argument(
        "--no-segments",
        action="store_true",
        help="plan requests as flat token ids (CDC alone), not as segmented chat requests (S2)",
    )
    q.add_argument("--data", default=None, help="data folder (default: the one shipped in irminsul/data)")
    q.set_defaults(func=quality)

    r = sub.add_parser("rotation", help="relative L2 error of δ-rotated k_r, layer 0 and every layer")
    _common(r, 8)
    r.add_argument("--data", default=None, help="data folder (default: the one shipped in irminsul/data)")
    r.set_defaults(func=rotation)

    c = sub.add_parser("roc", help="position-invariance AUC of c_KV, k_r, V and the GQA twin's K, V")
    _common(c, 100)  # the paper used 500 blocks: about 40 minutes on 2 cores
    c.add_argument(
        "--gqa",
        default=None,
        help="GQA (Llama) checkpoint, or 'random-twin' for the twin's "
        "architecture with random weights (default: the bundled twin, if present)",
    )
    c.add_argument("--block-tokens", type=int, default=64, help="tokens per block whose rows are compared")
    c.add_argument("--data", default=None, help="data folder (default: the one shipped in irminsul/data)")
    c.set_defaults(func=roc)

    k = sub.add_parser("cost", help="FLOPs, bytes, energy and CPU wall time a hit saves vs a miss")
    _common(k, 3)
    k.add_argument(
        "--gqa",
        default=None,
        help="GQA (Llama) checkpoint, or 'random-twin' (default: the bundled "
        "twin, else its architecture with random weights: FLOPs and wall time do not depend on them)",
    )
    k.add_argument("--prompt-tokens", type=int, default=4096, help="request length for the analytic models")
    k.add_argument("--shared-fraction", type=float, default=0.875, help="reused share of the request")
    k.add_argument(
        "--pj-per-flop", type=float, default=None, help="energy per FLOP, picojoules (default: the cost model's)"
    )
    k.add_argument(
        "--pj-per-byte", type=float, default=None, help="energy per byte moved, picojoules (default: the cost model's)"
    )
    k.set_defaults(func=cost)


def _setup(args) -> tuple[float, Path]:
    import torch

    from irminsul.bundled import bundled_model
    from irminsul.errors import ConfigError
    from irminsul.model.v4_serving import is_v4

    if args.threads:
        torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else bundled_model("mla")
    if is_v4(model):  # (its rows are not MLA's [c_KV | k_r], which these evaluations read)
        raise ConfigError(
            "irminsul eval measures MLA checkpoints; for DeepSeek-V4 run benchmarks/v4_reuse.py (docs/deepseek-v4.md)"
        )
    return time.time(), model


def _gqa(path: str | None, mla: Path, seed: int, fallback: bool) -> tuple[Path | None, str]:
    """(GQA checkpoint, how it was chosen): a path, the bundled twin, or a random-init twin."""
    from irminsul.bundled import ROOT
    from irminsul.research.eval.twin import random_twin

    if path and path != "random-twin":
        return Path(path), "given"
    if path is None and (ROOT / "gqa" / "config.json").exists():
        return ROOT / "gqa", "bundled twin (trained)"
    if path == "random-twin" or fallback:
        return random_twin(mla, seed), "twin architecture, random weights (trained twin absent)"
    return None, "absent"


def _text(model: Path, data: str | None):
    """(sampler of held-out text ids, [BOS]) for the model's tokenizer."""
    from irminsul.research.eval.tasks import TaskData

    d = TaskData(model, data)
    return (lambda rng, k: d.pool.filler(rng, k) if k > 0 else []), (d.bos,)


def quality(args) -> int:
    from irminsul.errors import UserFacingError
    from irminsul.model.config import ModelConfig
    from irminsul.research.eval.quality import STRATEGIES, run_quality
    from irminsul.research.eval.report import emit
    from irminsul.research.eval.tasks import TASKS, build_cases

    started, model = _setup(args)
    tasks = [t for t in args.tasks.split(",") if t]
    if bad := [t for t in tasks if t not in TASKS]:
        raise UserFacingError(f"unknown task(s) {', '.join(bad)}; choose from {', '.join(TASKS)}")
    strategies = STRATEGIES
    if args.strategies:
        wanted = args.strategies.split(",")
        strategies = tuple(s for s in STRATEGIES if s.name in wanted)
        if missing := set(wanted) - {s.name for s in strategies}:
            raise UserFacingError(
                f"unknown strategy {', '.join(sorted(missing))}; choose from {', '.join(s.name for s in STRATEGIES)}"
            )
    context = args.context or ModelConfig.from_file(model / "config.json").max_position_embeddings
    cases = build_cases(model, tasks, args.n, args.seed, context, args.data)
    result = run_quality(model, cases, strategies, args.greedy_tokens, dtype=args.dtype, segments=not args.no_segments)
    result.setup = {"segments": not args.no_segments, "context": context}
    emit("quality", result, args, str(model), started)
    return 0


def rotation(args) -> int:
    from irminsul.research.eval.report import emit
    from irminsul.research.eval.rotation import run_rotation

    started, model = _setup(args)
    sample, head = _text(model, args.data)
    emit("rotation", run_rotation(model, sample, args.n, args.seed, head=head), args, str(model), started)
    return 0


def roc(args) -> int:
    from irminsul.research.eval.report import emit
    from irminsul.research.eval.roc import run_roc

    started, model = _setup(args)
    sample, head = _text(model, args.data)
    gqa, how = _gqa(args.gqa, model, args.seed, fallback=False)
    result = run_roc(model, sample, gqa, args.n, args.block_tokens, seed=args.seed, head=head)
    if gqa is not None:
        result.gqa["weights"] = how
    emit("roc", result, args, str(model), started)
    return 0


def cost(args) -> int:
    import numpy as np
    from tqdm import tqdm

    from irminsul import LLM
    from irminsul.research.eval.accounting import Arch
    from irminsul.research.eval.cost import EnergyModel, run_cost
    from irminsul.research.eval.report import emit
    from irminsul.research.eval.shapes import DEEPSEEK_V2_LITE, QWEN3_32B, read_config
    from irminsul.research.eval.timing import time_gqa, time_mla

    started, model = _setup(args)
    bar = tqdm(total=3, desc="eval cost")
    given = {"pj_per_flop": args.pj_per_flop, "pj_per_byte": args.pj_per_byte}
    energy = EnergyModel(**{k: v for k, v in given.items() if v is not None})
    archs, lengths, timings = {}, {}, {}
    rng = np.random.default_rng(args.seed)
    raw = read_config(model)
    archs["mla"] = Arch.from_config(raw, "mla")
    lengths["mla"] = min(args.prompt_tokens, raw["max_position_embeddings"] * 3 // 4)
    llm = LLM(model, compile_decode=False)  # prefill timings: nothing decodes
    req = _request(rng, raw, lengths["mla"], args.shared_fraction, llm.tokenizer.bos_token_id)
    timings["mla"] = time_mla(llm, req, args.n)
    bar.update()
    gqa, how = _gqa(args.gqa, model, args.seed, fallback=True)
    if gqa is not None:
        from transformers import AutoModelForCausalLM

        graw = read_config(gqa)
        archs["gqa"] = Arch.from_config(graw, "gqa")
        lengths["gqa"] = min(args.prompt_tokens, graw["max_position_embeddings"] * 3 // 4)
        twin = AutoModelForCausalLM.from_pretrained(str(gqa), dtype="float32").eval()
        timings["gqa"] = time_gqa(
            twin, _request(rng, graw, lengths["gqa"], args.shared_fraction, graw.get("bos_token_id")), args.n
        )
    bar.update()
    archs["deepseek-v2-lite"] = Arch.from_config(DEEPSEEK_V2_LITE, "deepseek-v2-lite")
    archs["qwen3-32b-like"] = Arch.from_config(QWEN3_32B, "qwen3-32b-like")
    lengths |= {"deepseek-v2-lite": args.prompt_tokens, "qwen3-32b-like": args.prompt_tokens}
    result = run_cost(archs, lengths, args.shared_fraction, energy, timings)
    bar.update()
    bar.close()
    if "gqa" in result.models:
        result.models["gqa"]["weights"] = how
    emit("cost", result, args, str(model), started)
    return 0


def _request(rng, raw: dict, n: int, shared_fraction: float, bos):
    from irminsul.research.eval.cost import Scenario
    from irminsul.research.eval.timing import MovedSpan

    sc = Scenario.of(n, shared_fraction)
    head = (bos,) if bos is not None else ()
    return MovedSpan.random(
        rng, raw["vocab_size"], sc.header_tokens, sc.shared_tokens, n - sc.header_tokens - sc.shared_tokens, head
    )
