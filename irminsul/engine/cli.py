"""`irminsul demo`: find a fact in a document that moved, with and without position-independent reuse.

The same document (tau-bench's airline policy with a passkey sentence inserted) is asked about
twice, behind two metadata headers of different lengths, so the second time it sits at another
position. An exact-prefix cache (`prefix`, what SGLang and vLLM do) recomputes it; `pic` reuses its
rows: `c_KV` as it is, `k_r` rotated by the shift δ. The table shows the answers, where every prompt
row came from, and each request's time after a warm-up (the median of a few fresh caches).
"""

from __future__ import annotations

import statistics
import time

from irminsul.cli import at_least

HEADERS = ("request 1 agent=planner\n",
           "request 22 agent=support-bot tier=gold region=eu-west user=alice session=8812 locale=en-GB\n")
QUESTION, ANSWER_PREFIX = "\n\nWhat is the passkey?", "The passkey is"


def register(sub) -> None:
    p = sub.add_parser("demo", help="ask about a moved document with prefix caching and with pic reuse")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled MLA model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
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
    if 2 + len(tok.encode(HEADERS[1], add_bos=False)) + len(doc) + len(tail) + 8 > cfg.max_position_embeddings:
        raise UserFacingError(f"--doc-chars {args.doc_chars} makes the prompt longer than the model's "
                              f"{cfg.max_position_embeddings}-token context; use a smaller value")
    # Segments (S2): chunking restarts at the document, so it chunks alike behind either header.
    requests = [[[bos, user, *tok.encode(h, add_bos=False)], doc, tail] for h in HEADERS]
    warm = [[bos, user, *tok.encode("warm-up\n", add_bos=False)], tok.encode(text[::-1], add_bos=False), tail]
    print(f"document {len(doc)} tokens of tau-bench's airline policy; the passkey {key} is inside it\n")

    params = SamplingParams(max_tokens=6)

    def ask(engine: Engine, segments: list[list[int]]):
        starts = [sum(map(len, segments[:i])) for i in range(len(segments))]
        return engine.run(engine.add([t for s in segments for t in s], params, starts))

    rows, answers = [], {}
    for mode in ("prefix", "pic"):
        times: list[list[float]] = [[], []]
        for _ in range(args.repeats):
            # a fresh, empty cache on the loaded model's pool
            engine = Engine(llm.model, tok, reuse=mode, model_id=f"demo-{mode}", pool=llm.engine.pool,
                            compile_decode=False)
            ask(engine, warm)  # warm-up: kernels and allocator, nothing reusable
            for i, segments in enumerate(requests):
                t = time.perf_counter()
                out = ask(engine, segments)
                times[i].append(time.perf_counter() - t)
                answers[mode, i] = out
            engine.close()
        for i, segments in enumerate(requests):
            out, s = answers[mode, i], answers[mode, i].stats
            where = len(segments[0])
            answer = out.text.strip()
            rows.append((mode, f"{i + 1}", where, f"{answer} ({'right' if answer == key else 'wrong'})",
                         s.prefix_tokens, s.reused_tokens,
                         s.carve_out_tokens, s.computed_tokens, f"{statistics.median(times[i]) * 1e3:.0f} ms"))
            answers[mode, i, "ms"] = statistics.median(times[i]) * 1e3
    print(table(("mode", "request", "doc at", "answer", "prefix rows", "reused rows", "carve-out",
                 "computed rows", "time"), rows))
    pic, ref = answers["pic", 1], answers["prefix", 1]
    delta = len(requests[1][0]) - len(requests[0][0])
    print(f"\nRequest 2 moved the document by δ = {delta:+d} tokens. prefix recomputed all "
          f"{ref.stats.prompt_tokens} rows; pic computed {pic.stats.computed_tokens} and reused "
          f"{pic.stats.reused_tokens} ({pic.stats.reused_tokens / pic.stats.prompt_tokens:.0%}),")
    print(f"taking {answers['pic', 1, 'ms'] / answers['prefix', 1, 'ms']:.2f}x the time of the full recompute. "
          f"Answers: full recompute {ref.text.strip()!r}, pic {pic.text.strip()!r} (the passkey is {key}).")
    return 0
