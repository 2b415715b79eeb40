"""Serving benchmark: the same agent trace against a `--reuse prefix` and a `--reuse pic` server.

    python benchmarks/bench_serve.py TRACE [--model DIR] [--limit N] [--concurrency C] [--threads default,1]

Starts `irminsul serve` twice on loopback (same build, same model, one after the other), replays
the trace with `irminsul bench serve`'s client, and prints TTFT p50/p95, throughput, the share of
prompt tokens by kind, and the prefix/pic ratios measured in this run, with the machine. With
--threads default,1 each mode runs twice, the server at its default threads (what `irminsul serve`
picks without --threads) and with --threads 1, and the default/1 ratios are printed.

Without --model it uses a tiny random DeepSeek-V2 checkpoint with a 64k context carrying the real
Qwen2 tokenizer (so prompts have realistic token counts and the Qwen2.5 chat format applies); the
model's quality is irrelevant to TTFT and reuse. The bundled MLA model has a 2,048-token context,
shorter than every agent_meta prompt (4,000-9,000 tokens with its tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from irminsul.cli import run_for_people
from irminsul.errors import UserFacingError
from irminsul.machine import describe
from irminsul.research.bench_serve import replay, summarise
from irminsul.research.workloads.trace import read_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the clone's root, for tests/support
from tests.support.services import ServerProcess  # noqa: E402


def tiny_qwen2_checkpoint(path: Path) -> Path:
    """A tiny random DeepSeek-V2 with Qwen2's tokenizer and a 64k context (its tokenizer_config written
    at every run: one left by an earlier version is brought up to date)."""
    from irminsul.data import data_file
    from irminsul.model.tiny import make_tiny_checkpoint
    from irminsul.research.workloads.tokenizers import load_tokenizer

    if not (path / "config.json").exists():
        tok = load_tokenizer("qwen2").tokenizer
        vocab = tok.get_vocab_size(with_added_tokens=True)
        eos = tok.token_to_id("<|im_end|>")
        make_tiny_checkpoint(path, vocab_size=vocab, max_position_embeddings=65536, bos_token_id=None, eos_token_id=eos)
        tok.save(str(path / "tokenizer.json"))
    config = json.loads(data_file("tokenizers", "qwen2", "tokenizer_config.json").read_text())
    # without Qwen2's own Jinja template, which has no tool calls (an agent trace's assistant turns
    # carry them, with content null): the server renders Qwen2.5's format (model/chat_format.py QWEN2)
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return path


def default_model() -> Path:
    return tiny_qwen2_checkpoint(Path(tempfile.gettempdir()) / "irminsul-bench-tiny-qwen2")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--model", default=None)
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--modes", default="prefix,pic")
    p.add_argument(
        "--threads", default="default", help='comma-separated server threads: "default" (no --threads) or a count'
    )
    args = p.parse_args(argv)
    model = Path(args.model) if args.model else default_model()
    requests = read_trace(args.trace)[: args.limit]
    threads = args.threads.split(",")
    results = {}
    for mode, t in [(m, t) for m in args.modes.split(",") for t in threads]:
        extra = [] if t == "default" else ["--threads", t]
        name = mode if len(threads) == 1 else f"{mode}@{t}"
        server = ServerProcess("--model", str(model), "--reuse", mode, *extra, "--log-level", "warning", timeout=300)
        try:
            samples, duration, card, failures = asyncio.run(
                replay(server.url, requests, args.concurrency, args.max_tokens, progress=False)
            )
        finally:
            server.stop()
        if failures:  # the two modes must serve the same requests for their figures to compare
            raise UserFacingError(f"{name}: {len(failures)} requests failed; the first: {failures[0]}")
        results[name] = summarise(server.url, samples, duration, card, args.concurrency)
        print(f"{name}: done ({duration:.0f} s)", file=sys.stderr)
    first = next(iter(results.values()))
    print(f"model {model}  machine {describe()}")
    print(
        f"trace {args.trace}: {first.requests} requests, {first.sessions} sessions, concurrency "
        f"{args.concurrency}, max_tokens {args.max_tokens}, {first.prompt_tokens} prompt tokens"
    )
    print(
        f"{'reuse':<10} {'TTFT p50':>9} {'TTFT p95':>9} {'req/s':>7} {'prompt tok/s':>13} "
        f"{'prefix':>7} {'reused':>7} {'computed':>9}"
    )
    for mode, r in results.items():
        f = r.fraction
        print(
            f"{mode:<10} {r.ttft_p50_s * 1e3:>7.0f}ms {r.ttft_p95_s * 1e3:>7.0f}ms {r.requests_per_s:>7.3f} "
            f"{r.prompt_tokens_per_s:>13.0f} {f['prefix']:>7.1%} {f['reused']:>7.1%} {f['computed']:>9.1%}"
        )
    if {"prefix", "pic"} <= results.keys():
        a, b = results["prefix"], results["pic"]
        print(
            f"prefix/pic: TTFT p50 {a.ttft_p50_s / b.ttft_p50_s:.2f}x, p95 {a.ttft_p95_s / b.ttft_p95_s:.2f}x, "
            f"throughput pic/prefix {b.requests_per_s / a.requests_per_s:.2f}x"
        )
    if "default" in threads and len(threads) > 1:
        for mode in args.modes.split(","):
            for t in threads:
                if t != "default":
                    a, b = results[f"{mode}@default"], results[f"{mode}@{t}"]
                    print(
                        f"{mode}: default/{t} thread(s): TTFT p50 {a.ttft_p50_s / b.ttft_p50_s:.2f}x, "
                        f"p95 {a.ttft_p95_s / b.ttft_p95_s:.2f}x, throughput {a.requests_per_s / b.requests_per_s:.2f}x"
                    )
    return 0


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
