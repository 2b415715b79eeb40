"""`irminsul demo`: generate from the bundled model and show where each prompt row came from."""

from __future__ import annotations

import platform
import time

DEMO_DOC = (
    "Baggage policy. Each passenger may bring one personal item and one carry-on bag. Checked bags "
    "are free for gold members; silver members get one free checked bag; regular members pay 50 "
    "dollars per bag. A reservation can be modified only if it was booked less than 24 hours ago or "
    "if the passenger bought travel insurance. Basic economy flights cannot be changed. "
)


def register(sub) -> None:
    p = sub.add_parser("demo", help="generate from the bundled model and show what the cache reused")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled MLA model)")
    p.add_argument("--reuse", default="pic", choices=["off", "prefix", "naive", "pic"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-tokens", type=int, default=24)
    p.set_defaults(func=run)


def run(args) -> int:
    from irminsul import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, reuse=args.reuse)
    cfg = llm.model.config
    print(f"model  {llm.path}  ({cfg.model_type}, {cfg.num_hidden_layers} layers, "
          f"kv_lora_rank {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim}; loaded in {time.perf_counter() - t0:.2f}s)")
    print(f"reuse  {args.reuse}    machine {platform.machine()} {platform.processor() or ''}".rstrip())
    doc = llm.tokenizer.encode(DEMO_DOC * 4, add_bos=False)
    turns = [
        ("first request", "request-id 1 agent=planner\n", "Can I change a basic economy flight?"),
        ("same doc, new header", "request-id 22 agent=support-bot profile=gold\n", "How many bags are free?"),
        ("same doc, longer header", "request-id 333 agent=router user=alice tier=silver region=eu\n",
         "Who pays for checked bags?"),
    ]
    for name, header, question in turns:
        # Segment-aligned chat rendering (S2): the system header, the shared document, the user turn.
        segments = [llm.tokenizer.encode(f"<|system|>{header}"), doc,
                    llm.tokenizer.encode(f"<|end|><|user|>{question}<|end|><|assistant|>", add_bos=False)]
        t = time.perf_counter()
        out = llm.generate(segments, max_tokens=args.max_tokens, temperature=0.0)
        dt = time.perf_counter() - t
        s = out.stats
        print(f"\n[{name}] {s.prompt_tokens} prompt tokens: prefix {s.prefix_tokens}, reused {s.reused_tokens} "
              f"(carve-out recomputed {s.carve_out_tokens}), computed {s.computed_tokens}; "
              f"{s.generated_tokens} generated in {dt:.2f}s")
        print(f"  -> {out.text!r}")
    return 0
