"""`irminsul demo`: find a fact in a document that moved, with and without position-independent reuse.

The same document (tau-bench's airline policy with a passkey sentence inserted) is asked about
twice, behind two metadata headers of different lengths, so the second time it sits at another
position. An exact-prefix cache (`prefix`, what SGLang and vLLM do) recomputes it; `pic` reuses its
rows: `c_KV` as it is, `k_r` rotated by the shift δ. The table shows the answers, where every prompt
row came from, and each request's time: both modes are warmed up first (on prompts of the same
shapes, in caches that are then dropped), then run alternately, each repeat from an empty cache, and
the time is the median of the repeats.
"""

from __future__ import annotations

import statistics
import time

from irminsul.cli import at_least

HEADERS = (
    "request 1 agent=planner\n",
    "request 22 agent=support-bot tier=gold region=eu-west user=alice session=8812 locale=en-GB\n",
)
QUESTION, ANSWER_PREFIX = "\n\nWhat is the passkey?", "The passkey is"


def register(sub) -> None:
    p = sub.add_parser("demo", help="ask about a moved document with prefix caching and with pic reuse")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled MLA model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype")
    # NOTE: the bundled model finds the passkey for 7 of seeds 0-9 (at both header lengths; its
    # recall is in its model card); the default is one it gets right, so the demo shows reuse.
    p.add_argument("--seed", type=int, default=3, help="picks the passkey and where it sits in the document")
    p.add_argument("--doc-chars", type=at_least(1), default=3000, help="length of the document (characters of policy)")
    p.add_argument("--repeats", type=at_least(1), default=3, help="fresh caches per mode; times are their median")
    p.add_argument("--threads", type=at_least(1), default=1, help="torch CPU threads")
    p.set_defaults(func=run)


def document(seed: int, chars: int) -> tuple[str, str]:
    """(policy text with a passkey sentence at a seeded depth, the passkey)."""
    import numpy as np

    from irminsul.data import data_file

    rng = np.random.default_rng(seed)
    policy = data_file("tau_bench", "airline_wiki.md").read_text()[:chars]
    key = str(int(rng.integers(10_000, 100_000)))
    cut = policy.rfind(". ", 0, int(len(policy) * rng.uniform(0.2, 0.8))) + 1
    return policy[:cut] + f" The passkey is {key}. Remember it." + policy[cut:], key


def run(args) -> int:
    import torch

    from irminsul import LLM
    from irminsul.engine.build import build_engine
    from irminsul.engine.config import EngineConfig
    from irminsul.engine.engine import Engine
    from irminsul.engine.sampling import SamplingParams
    from irminsul.errors import UserFacingError
    from irminsul.machine import describe
    from irminsul.model.chat_format import BOS, END, ROLE_TOKENS
    from irminsul.table import table

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, reuse="off", compile_decode=False)  # six-token answers: not worth compiling
    tok, cfg = llm.tokenizer, llm.model.config
    marks = [tok.token_to_id(t) for t in (BOS, ROLE_TOKENS["user"], END, ROLE_TOKENS["assistant"])]
    if None in marks:
        raise UserFacingError(f"{llm.path} does not use the bundled models' chat tokens; the demo needs them")
    bos, user, end, assistant = marks
    print(f"model    {llm.path} (loaded in {time.perf_counter() - t0:.1f} s)")
    if args.model is None:
        print("         the bundled reference model: a 6.6 M-parameter DeepSeek-V2-architecture model (MLA,")
        print("         kv_lora_rank 128 + rope 16, 4 layers) trained on this project's CPU to find facts in")
        print("         documents. An instrument for measuring reuse, not an assistant: see its MODEL_CARD.md.")
    print(f"machine  {describe()}")

    text, key = document(args.seed, args.doc_chars)
    doc = tok.encode(text, add_bos=False)
    tail = tok.encode(QUESTION, add_bos=False) + [end, assistant] + tok.encode(ANSWER_PREFIX, add_bos=False)
    params = SamplingParams(max_tokens=6)
    # Segments (S2): chunking restarts at the document, so it chunks alike behind either header.
    requests = [[[bos, user, *tok.encode(h, add_bos=False)], doc, tail] for h in HEADERS]
    # The warm-up asks the same shapes (the document's tokens reversed: nothing in them is reusable
    # by the measured requests, which start from empty caches anyway).
    warm = [[head, doc[::-1], tail] for head, _, _ in requests]
    longest = max(sum(map(len, r)) for r in requests)
    if longest + params.max_tokens > cfg.max_position_embeddings:
        raise UserFacingError(
            f"--doc-chars {args.doc_chars} makes the prompt {longest} tokens, and with the "
            f"{params.max_tokens}-token answer more than the model's {cfg.max_position_embeddings}"
            f"-token context; use a smaller value"
        )
    print(f"document {len(doc)} tokens of tau-bench's airline policy; the passkey {key} is inside it\n")

    def ask(engine: Engine, segments: list[list[int]]):
        starts = [sum(map(len, segments[:i])) for i in range(len(segments))]
        return engine.run(engine.add([t for s in segments for t in s], params, starts))

    def fresh(mode: str) -> Engine:  # an empty cache on the loaded model's pool
        return build_engine(
            EngineConfig.of(reuse=mode, model_id=f"demo-{mode}", compile_decode=False),
            llm.model,
            tok,
            pool=llm.engine.pool,
        )

    modes = ("prefix", "pic")
    for mode in modes:  # kernels, allocator and each mode's reuse path, before anything is timed
        engine = fresh(mode)
        for segments in warm:
            ask(engine, segments)
        engine.close()
    times: dict[tuple[str, int], list[float]] = {(mode, i): [] for mode in modes for i in range(len(requests))}
    answers = {}
    for _ in range(args.repeats):
        for mode in modes:  # alternately, so neither mode gets the quieter moments
            engine = fresh(mode)
            for i, segments in enumerate(requests):
                t = time.perf_counter()
                answers[mode, i] = ask(engine, segments)
                times[mode, i].append(time.perf_counter() - t)
            engine.close()
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    rows = []
    for mode in modes:
        for i, segments in enumerate(requests):
            out, s = answers[mode, i], answers[mode, i].stats
            answer = out.text.strip()
            rows.append(
                (
                    mode,
                    f"{i + 1}",
                    len(segments[0]),
                    f"{answer} ({'right' if answer == key else 'wrong'})",
                    s.prefix_tokens,
                    s.reused_tokens,
                    s.carve_out_tokens,
                    f"{s.computed_tokens} / {s.prompt_tokens}",
                    f"{ms[mode, i]:.0f} ms",
                )
            )
    print(
        table(
            (
                "mode",
                "request",
                "doc at",
                "answer",
                "prefix rows",
                "reused rows",
                "carve-out",
                "computed / prompt",
                "time",
            ),
            rows,
        )
    )
    print(f"""
doc at             the position of the document's first token (after the header)
prefix rows        rows the exact-prefix cache had: the same tokens from position 0
reused rows        rows found by content at another position (c_KV as stored, k_r read at its new position)
carve-out          rows the cache had but computed anyway (counted in computed): positions < 32, here or where
                   they were stored (the attention sink belongs to the sequence's start)
computed / prompt  rows this request computed, of its prompt's rows
time               the request's prefill and {params.max_tokens}-token answer, the median of {args.repeats} \
empty cache{"s" if args.repeats > 1 else ""} per mode""")
    pic, ref = answers["pic", 1], answers["prefix", 1]
    delta = len(requests[1][0]) - len(requests[0][0])
    print(
        f"\nRequest 2 moved the document by δ = {delta:+d} tokens. prefix recomputed "
        f"{ref.stats.computed_tokens} of {ref.stats.prompt_tokens} rows; pic computed {pic.stats.computed_tokens} "
        f"and reused {pic.stats.reused_tokens} ({pic.stats.reused_tokens / pic.stats.prompt_tokens:.0%}),"
    )
    print(
        f"taking {ms['pic', 1] / ms['prefix', 1]:.2f}x the time of the full recompute. "
        f"Answers: full recompute {ref.text.strip()!r}, pic {pic.text.strip()!r} (the passkey is {key})."
    )
    return 0
