"""`irminsul train-reference`: train a bundled reference model."""

import dataclasses

from irminsul.cli import at_least
from irminsul.errors import UserFacingError
from irminsul.research.train.arch import ReferenceShape


def register(subparsers) -> None:
    p = subparsers.add_parser("train-reference", help="train the small MLA reference model or its GQA twin")
    p.add_argument(
        "--arch",
        choices=("mla", "gqa", "v4"),
        default="mla",
        help="the model: MLA (the bundled reference), its GQA twin, or DeepSeek-V4's blocks",
    )
    p.add_argument("--out", default=None, help="output folder (default runs/<arch>)")
    p.add_argument("--minutes", type=float, default=75.0, help="wall-clock budget (fits --steps to it if unset)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (fixes the schedule: reproducible)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order")
    p.add_argument("--threads", type=at_least(1), default=2, help="torch CPU threads")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--eval-every", type=int, default=250, help="steps between held-out evaluations")
    p.add_argument("--ckpt-minutes", type=float, default=10.0, help="minutes between checkpoints")
    p.add_argument("--data", default=None, help="data folder (default: the one shipped in irminsul/data)")
    p.add_argument("--init", default=None, help="start from this checkpoint's weights (second stage)")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many steps of the schedule")
    p.add_argument(
        "--start-step",
        type=int,
        default=0,
        help="resume the --steps schedule here (with --init: finish a run the wall-clock guard stopped)",
    )
    p.add_argument("--warmup", type=int, default=60, help="learning-rate warm-up steps")
    p.add_argument("--copy-steps", type=int, default=0, help="steps whose retrieval examples are all copy tasks")
    p.add_argument("--mix", default=None, help="task shares, e.g. passkey=0.4,kv=0.25,doc_qa=0.25,tool=0.1")
    p.add_argument(
        "--phases", default=None, help="length x batch : share of steps, e.g. 256x8:0.4,512x4:0.2,1024x2:0.2,2048x1:0.2"
    )
    p.add_argument(
        "--attn-weight",
        type=float,
        default=1.0,
        help="weight of the attention and copy losses on the supervised heads (0: off)",
    )
    p.add_argument("--attn-heads", type=int, default=4, help="supervised heads 0..N-1 of the last layer")
    p.add_argument("--untied", action="store_true", help="separate input and output embeddings")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model for smoke tests")
    p.set_defaults(func=run)

    e = subparsers.add_parser("eval-reference", help="held-out loss, needle recall and QA of a reference checkpoint")
    e.add_argument("--model", required=True, help="checkpoint folder")
    e.add_argument("--engine", action="store_true", help="also evaluate through irminsul.LLM (reuse off)")
    e.add_argument("--needles", type=int, default=4, help="needles per (context, depth) cell")
    e.add_argument("--qa-items", type=int, default=120, help="MuSiQue items to answer")
    e.add_argument("--synthetic", type=int, default=20, help="probes per synthetic task and length")
    e.add_argument("--threads", type=at_least(1), default=2, help="torch CPU threads")
    e.add_argument("--data", default=None, help="data folder (default: the one shipped in irminsul/data)")
    e.add_argument("--out", default=None, help="write the metrics (JSON) to this file (default: print them)")
    e.add_argument(
        "--card", action="store_true", help="(re)write MODEL/MODEL_CARD.md and MODEL/metrics.json from this run"
    )
    e.add_argument("--notes", default="", help="a file whose text goes into the card's Notes section")
    e.set_defaults(func=run_eval)


def run(args) -> int:
    from irminsul.research.train.train import TrainConfig, train

    shape = ReferenceShape(tie_embeddings=not args.untied)
    if args.tiny:
        shape = dataclasses.replace(
            shape,
            hidden=64,
            layers=2,
            heads=4,
            kv_heads=2,
            kv_lora_rank=32,
            qk_rope_head_dim=4,
            qk_nope_head_dim=12,
            v_head_dim=16,
            dense_intermediate=128,
            moe_intermediate=32,
        )
    cfg = TrainConfig(
        arch=args.arch,
        out=args.out or f"runs/{args.arch}",
        steps=args.steps,
        minutes=args.minutes,
        seed=args.seed,
        threads=args.threads,
        lr=args.lr,
        eval_every=args.eval_every,
        ckpt_minutes=args.ckpt_minutes,
        data=args.data,
        shape=shape,
        init=args.init,
        stop_after=args.stop_after,
        start_step=args.start_step,
        warmup=args.warmup,
        copy_steps=args.copy_steps,
        attn_weight=args.attn_weight,
        attn_heads=args.attn_heads,
        **({"phases": parse_phases(args.phases)} if args.phases else {}),
        **({"mix": parse_mix(args.mix)} if args.mix else {}),
    )
    train(cfg)
    return 0


def parse_phases(text: str) -> tuple[tuple[int, int, float], ...]:
    """'256x8:0.4,512x4:0.6' -> ((256, 8, 0.4), (512, 4, 0.6)), or a UserFacingError."""
    import re

    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)x(\d+):(\S+)\s*", part)
        try:
            share = float(m.group(3)) if m else -1.0
        except ValueError:
            share = -1.0
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1 or not 0 < share < float("inf"):
            raise UserFacingError(f"--phases: {part!r} is not LENGTHxBATCH:SHARE (e.g. 256x8:0.4)")
        out.append((int(m.group(1)), int(m.group(2)), share))
    return tuple(out)


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    """'passkey=0.4,kv=0.6' -> (("passkey", 0.4), ("kv", 0.6)), or a UserFacingError naming the tasks."""
    from irminsul.research.train.tasks import KINDS

    out = []
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if not sep or name not in KINDS or not share >= 0:
            raise UserFacingError(f"--mix: {part!r} is not TASK=SHARE with a task among {', '.join(KINDS)}")
        out.append((name, share))
    if not sum(s for _, s in out) > 0:
        raise UserFacingError("--mix: the shares add up to 0")
    return tuple(out)


def run_eval(args) -> int:
    import json
    import shlex
    import sys
    from pathlib import Path

    import torch

    from irminsul.research.train.card import write_card
    from irminsul.research.train.evaluate import evaluate, save

    torch.set_num_threads(args.threads)
    res = evaluate(
        Path(args.model),
        engine=args.engine,
        n_needles=args.needles,
        qa_items=args.qa_items,
        doc_qa_n=args.synthetic,
        data=args.data,
    )
    written = [Path(args.out)] if args.out else []
    if args.card:
        written.append(Path(args.model) / "metrics.json")
    for path in written:
        save(res, path)
        print(f"wrote {path}", file=sys.stderr)
    if not written:
        print(json.dumps(res, indent=2))
    if args.card:
        eval_cmd = "irminsul " + " ".join(shlex.quote(a) for a in _measuring_args(sys.argv[1:]))
        notes = Path(args.notes).read_text() if args.notes else ""
        card = write_card(Path(args.model), res, eval_cmd, notes)
        print(f"wrote {card}", file=sys.stderr)
    return 0


def _measuring_args(argv: list[str]) -> list[str]:
    """The eval-reference arguments that change a number (not --card, --out or --notes)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--notes", "--out"):
            skip = True
        elif a != "--card" and not a.startswith(("--notes=", "--out=")):
            out.append(a)
    return out
