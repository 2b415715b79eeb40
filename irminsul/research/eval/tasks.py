"""Shifted-reuse cases for the quality evaluation.

Each case holds shared content that is first cached in one context (`first`) and then requested
at another position after different content (`prompt`), with a reference `answer` to score.
The content and question formats are the reference models' own retrieval tasks
(`irminsul.research.train.tasks`) over held-out text, and the agent header is the workloads'
`agent_meta` pattern, so the model is asked what it was trained to answer:

- `niah`: a passkey haystack after `depth` tokens of other text, requested after `depth + delta`
  tokens of different text (a sweep over depth and shift);
- `musique`: MuSiQue passages as "Document [i]" slots, cached in one order and requested in
  another (the model's doc-QA format: quote a span, answer with the words that follow);
- `agent_meta`: a held-out tau-bench conversation behind one `<agent-metadata>` header, then
  behind another of different length; the answer is the logged assistant reply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from irminsul.data import data_dir as find_data_dir
from irminsul.model.chat_format import BOS, END, ROLE_TOKENS
from irminsul.research.train import tasks as train_tasks
from irminsul.research.train.data import Corpus, is_held_out, render_chat
from irminsul.research.train.retrieval import NEEDLE_DEPTHS
from irminsul.research.train.tokenizer import load_tokenizer
from irminsul.research.workloads.patterns import agent_meta
from irminsul.research.workloads.trace import TraceRequest

TASKS = ("niah", "musique", "agent_meta")
# How `train.tasks.doc_qa` asks; `musique` checks that it still does.
DOC_QA_QUESTION = '\n\nWhich words follow "'


@dataclass(frozen=True)
class ShiftedCase:
    task: str
    first: list[int]  # the context that caches the shared content
    prompt: list[int]  # the request: the shared content at another position, then the question
    answer: list[int]  # reference answer, teacher-forced
    depth: int  # differing tokens before the cached copy (how much other context it was computed after)
    delta: int  # p_tgt - p_src of the shared content (of the answer-bearing document for musique)
    shared: int  # tokens of shared content
    scoring: str = "exact"  # "exact": all answer tokens right; "tokens": fraction of answer tokens right
    # Segment starts (offsets into first / prompt) as a chat request's rendering gives them: each
    # document, header, message and question is its own segment, so S2 can restart chunking there.
    first_segments: tuple[int, ...] = ()
    prompt_segments: tuple[int, ...] = ()


def _joined(*parts: list[int]) -> tuple[list[int], tuple[int, ...]]:
    """Concatenate the non-empty parts; return the ids and each part's start."""
    ids, starts = [], []
    for part in parts:
        if part:
            starts.append(len(ids))
            ids += part
    return ids, tuple(starts)


@dataclass(frozen=True)
class Sweep:
    """The NIAH grid: depth of the cached copy x shift of the request (cells where depth+delta >= 0)."""

    depths: tuple[int, ...] = (16, 128, 384)
    deltas: tuple[int, ...] = (-112, 8, 112, 384)

    def cells(self) -> list[tuple[int, int]]:
        return [(a, d) for a in self.depths for d in self.deltas if a + d >= 0]

    def scaled(self, context: int) -> Sweep:
        """The grid for a model whose context is `context` tokens (the defaults fit 2048)."""
        f = min(1.0, context / 2048)
        return Sweep(tuple(max(1, int(a * f)) for a in self.depths), tuple(int(d * f) for d in self.deltas))


class TaskData:
    """Held-out text of the reference models' split, tokenised with the checkpoint's tokenizer."""

    def __init__(self, model_dir: str | Path, data_dir: str | Path | None = None):
        self.data_dir = find_data_dir(data_dir)
        self.tok = load_tokenizer(Path(model_dir))
        corpus = Corpus.load(self.data_dir)
        self.pool = train_tasks.TokenPool(self.tok, corpus.held_out, corpus.tools_held_out, corpus.words)
        self.bos, self.end = self.tok.token_to_id(BOS), self.tok.token_to_id(END)
        self.user, self.asst = (self.tok.token_to_id(ROLE_TOKENS[r]) for r in ("user", "assistant"))


def _find(seq: list[int], sub: list[int], start: int = 0) -> int:
    for i in range(start, len(seq) - len(sub) + 1):
        if seq[i : i + len(sub)] == sub:
            return i
    return -1


def _split_tail(d: TaskData, ex: train_tasks.Example) -> tuple[list[int], list[int]]:
    """A retrieval example -> (haystack, question tail). Every `train.tasks` question opens with a
    blank line after the haystack, so the tail starts at the last "\n\n" before the user turn ends."""
    ids = ex.prompt_ids
    assert ids[:2] == [d.bos, d.user], "train.tasks changed its prompt layout"
    end = len(ids) - 1 - ids[::-1].index(d.end)
    for q in range(end - 1, 1, -1):
        if d.tok.decode(ids[q:end]).startswith("\n\n"):
            return ids[2:q], ids[q:]
    raise AssertionError("train.tasks changed its question format (no blank line before the question)")


def niah(d: TaskData, rng: np.random.Generator, body_tokens: int, depth: int, delta: int) -> ShiftedCase:
    ex = train_tasks.passkey(d.pool, rng, body_tokens, depth=float(rng.choice(NEEDLE_DEPTHS)), n_digits=5)
    haystack, tail = _split_tail(d, ex)
    head = [d.bos, d.user]
    first, fs = _joined(head, d.pool.filler(rng, depth), haystack)
    prompt, ps = _joined(head, d.pool.filler(rng, depth + delta), haystack, tail)
    return ShiftedCase(
        "niah",
        first,
        prompt,
        ex.answer_ids[: ex.answer_len],
        depth,
        delta,
        len(haystack),
        first_segments=fs,
        prompt_segments=ps,
    )


def musique(d: TaskData, rng: np.random.Generator, body_tokens: int, min_docs: int = 3) -> ShiftedCase:
    for _ in range(100):
        ex = train_tasks.doc_qa(d.pool, rng, body_tokens)
        q = _find(ex.prompt_ids, d.pool.enc(DOC_QA_QUESTION))
        assert q > 0, "train.tasks.doc_qa changed its question"
        starts = []
        for k in range(1, 64):
            at = _find(ex.prompt_ids, d.pool.enc(f"Document [{k}]: "), starts[-1] + 1 if starts else 2)
            if at < 0 or at > q:
                break
            starts.append(at)
        if len(starts) >= min_docs:
            break
    else:
        raise ValueError("could not build a MuSiQue case with enough documents; raise body_tokens")
    assert starts[0] == 2, "train.tasks.doc_qa changed its document format"
    blocks = [ex.prompt_ids[a:b] for a, b in zip(starts, starts[1:] + [q])]
    quote = ex.prompt_ids[q + len(d.pool.enc(DOC_QA_QUESTION)) :][:8] + ex.answer_ids[: ex.answer_len]
    gold = next(i for i, b in enumerate(blocks) if _find(b, quote) >= 0)
    order1 = rng.permutation(len(blocks))
    order2 = rng.permutation(len(blocks))
    while order2.tolist().index(gold) == order1.tolist().index(gold):  # the answer's slot must move
        order2 = rng.permutation(len(blocks))

    def before(order) -> int:
        return 2 + sum(len(blocks[i]) for i in order[: order.tolist().index(gold)])

    head = [d.bos, d.user]
    first, fs = _joined(head, *(blocks[i] for i in order1))
    prompt, ps = _joined(head, *(blocks[i] for i in order2), ex.prompt_ids[q:])
    depth = before(order1) - 2
    return ShiftedCase(
        "musique",
        first,
        prompt,
        ex.answer_ids[: ex.answer_len],
        depth,
        before(order2) - before(order1),
        sum(map(len, blocks)),
        first_segments=fs,
        prompt_segments=ps,
    )


class AgentConversations:
    """Held-out tau-bench airline conversations, cut before each assistant turn."""

    def __init__(self, d: TaskData, max_body: int, answer_tokens: int = 32, min_body: int = 96):
        trajs = json.loads((d.data_dir / "tau_bench" / "gpt-4o-airline.json").read_text())
        self.turns = []  # (session, messages before the turn, ids of each message, answer ids)
        for t in trajs:
            if not is_held_out(render_chat(t["traj"])):
                continue  # the reference models trained on the other trajectories
            msgs = [m for m in t["traj"] if m["role"] != "system"]  # the policy alone exceeds the context
            for i, m in enumerate(msgs):
                if m["role"] != "assistant" or i == 0:
                    continue
                body: list[list[int]] = []
                size = 0  # tokens in body
                for prev in reversed(msgs[:i]):  # whole messages, newest first, within max_body
                    ids = d.tok.encode(render_chat([prev])).ids
                    if size + len(ids) > max_body:
                        break
                    body.insert(0, ids)
                    size += len(ids)
                answer = d.tok.encode(render_chat([m])).ids[1 : answer_tokens + 1]  # drop <|assistant|>
                if size >= min_body and answer:
                    self.turns.append(
                        (f"tau-{t['task_id']}-{t['trial']}", tuple(msgs[i - len(body) : i]), body, answer)
                    )


def agent_meta_case(d: TaskData, conv: AgentConversations, rng: np.random.Generator) -> ShiftedCase:
    session, msgs, body, answer = conv.turns[int(rng.integers(len(conv.turns)))]
    seeds = rng.integers(0, 2**31, 2)
    headers = []
    for s in seeds:
        (req,) = agent_meta([TraceRequest(session, msgs)], seed=int(s))
        headers.append(d.tok.encode(render_chat([req.messages[0]])).ids)
    first, fs = _joined([d.bos], headers[0], *body)
    prompt, ps = _joined([d.bos], headers[1], *body, [d.asst])
    return ShiftedCase(
        "agent_meta",
        first,
        prompt,
        answer,
        len(headers[0]),
        len(headers[1]) - len(headers[0]),
        sum(map(len, body)),
        scoring="tokens",
        first_segments=fs,
        prompt_segments=ps,
    )


def build_cases(
    model_dir: str | Path,
    task_names=TASKS,
    n: int = 24,
    seed: int = 0,
    context: int = 2048,
    data_dir: str | Path | None = None,
    sweep: Sweep = Sweep(),
) -> dict[str, list[ShiftedCase]]:
    """`n` cases per task, sized for a model with a `context`-token window."""
    d = TaskData(model_dir, data_dir)
    sweep = sweep.scaled(context)
    f = min(1.0, context / 2048)
    out: dict[str, list[ShiftedCase]] = {}
    for task in task_names:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
        rng = np.random.default_rng([seed, TASKS.index(task)])  # a task's cases do not depend on the others
        if task == "niah":
            cells = sweep.cells()
            out[task] = [niah(d, rng, int(768 * f), *cells[i % len(cells)]) for i in range(n)]
        elif task == "musique":
            out[task] = [musique(d, rng, int(1024 * f)) for _ in range(n)]
        elif task == "agent_meta":
            conv = AgentConversations(d, max_body=int(1024 * f))
            out[task] = [agent_meta_case(d, conv, rng) for _ in range(n)]
    return out
