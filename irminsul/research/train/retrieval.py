"""Retrieval evaluations: needle-in-a-haystack recall and multi-document QA accuracy.

They take callables, not a model, so the same functions measure transformers, our engine with
reuse `off`, `naive` or `pic`, or a fake in tests:

- `ScoreFn(prompt_ids, continuation_ids) -> log-probs [len(continuation), vocab]`
  (the signature of `irminsul.LLM.score`);
- `GenerateFn(prompt_ids, max_tokens) -> generated ids` (greedy; may stop at `<|end|>`).

`hf_score` / `hf_generate` wrap a transformers causal LM into those callables.
"""

import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from irminsul.model.chat_format import BOS, END, ROLE_TOKENS
from irminsul.research.train.tasks import Example, TokenPool, passkey

ScoreFn = Callable[[list[int], list[int]], torch.Tensor]
GenerateFn = Callable[[list[int], int], list[int]]

NEEDLE_LENGTHS = (512, 1024, 2048)
NEEDLE_DEPTHS = (0.05, 0.25, 0.5, 0.75, 0.95)


@dataclass(frozen=True)
class ProbeScore:
    kind: str
    n_tokens: int
    logprob: float  # mean log-prob per answer token, teacher-forced
    exact: bool  # every answer token is the argmax (= greedy decoding reproduces the answer)


def score_examples(score: ScoreFn, examples: Sequence[Example]) -> list[ProbeScore]:
    out = []
    for ex in examples:
        ans = ex.answer_ids[: ex.answer_len]  # the value, without <|end|>
        lp = score(ex.prompt_ids, ans)  # [len(ans), vocab]
        target = torch.tensor(ans)
        tok_lp = lp[torch.arange(len(ans)), target]
        out.append(ProbeScore(ex.kind, len(ex.ids), float(tok_lp.mean()), bool((lp.argmax(-1) == target).all())))
    return out


def needle_examples(
    pool: TokenPool, lengths=NEEDLE_LENGTHS, depths=NEEDLE_DEPTHS, per_depth: int = 4, n_digits: int = 5, seed: int = 0
) -> list[Example]:
    """Passkey probes over a grid of context lengths x needle depths, from `pool` (use held-out)."""
    rng = np.random.default_rng(seed)
    return [
        passkey(pool, rng, n, depth=d, n_digits=n_digits) for n in lengths for d in depths for _ in range(per_depth)
    ]


@dataclass(frozen=True)
class NeedleReport:
    recall: dict[int, float]  # context length -> fraction of needles generated exactly
    logprob: dict[int, float]  # context length -> mean answer-token log-prob (nan without score)
    n: dict[int, int]

    def row(self) -> str:
        return "  ".join(
            f"{n}: {self.recall[n]:.2f} (lp {self.logprob[n]:.2f}, n={self.n[n]})" for n in sorted(self.recall)
        )


def needle_recall(examples: Sequence[Example], generate: GenerateFn, score: ScoreFn | None = None) -> NeedleReport:
    """Recall at full prefill: greedy generation from the prompt must reproduce the value exactly."""
    hits: dict[int, list[bool]] = {}
    lps: dict[int, list[float]] = {}
    for ex in examples:
        n = _bucket(len(ex.ids))
        value = ex.answer_ids[: ex.answer_len]
        got = generate(ex.prompt_ids, ex.answer_len + 1)
        hits.setdefault(n, []).append(list(got[: ex.answer_len]) == value)
        if score is not None:
            lps.setdefault(n, []).append(score_examples(score, [ex])[0].logprob)
    return NeedleReport(
        recall={n: float(np.mean(h)) for n, h in hits.items()},
        logprob={n: float(np.mean(lps[n])) if n in lps else float("nan") for n in hits},
        n={n: len(h) for n, h in hits.items()},
    )


def _bucket(n_tokens: int) -> int:
    """Round a probe's length to the grid length it was built for."""
    return min(NEEDLE_LENGTHS + (256,), key=lambda g: abs(g - n_tokens))


# --- multi-document QA over MuSiQue -------------------------------------------------------


@dataclass(frozen=True)
class QAItem:
    prompt_ids: list[int]
    answers: list[str]


def musique_prompts(tok, items: Sequence[dict], max_tokens: int = 2000) -> list[QAItem]:
    """MuSiQue items as "Document [i]: ..." prompts that fit `max_tokens`.

    Passages that contain a gold answer go first (so the answer is always in context), then
    distractors in their original order until the budget is spent; documents are then numbered
    in that order.
    """
    out = []
    bos, user, end, asst = (tok.token_to_id(t) for t in (BOS, ROLE_TOKENS["user"], END, ROLE_TOKENS["assistant"]))
    for item in items:
        gold = [normalize(a) for a in item["answers"]]
        ctxs = sorted(item["ctxs"], key=lambda c: not any(g and g in normalize(c["text"]) for g in gold))
        q = tok.encode(f"\n\nQuestion: {item['question']}").ids
        tail = [end, asst] + tok.encode("Answer:").ids
        body: list[int] = []
        for i, c in enumerate(ctxs):
            ids = tok.encode(f"Document [{i + 1}]: {c['text']}\n").ids
            room = max_tokens - 2 - len(q) - len(tail) - len(body)
            if room <= 32:
                break
            body += ids[:room]
        out.append(QAItem([bos, user] + body + q + tail, list(item["answers"])))
    return out


def normalize(s: str) -> str:
    """SQuAD-style answer normalisation: lowercase, drop punctuation and articles, squeeze spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


@dataclass(frozen=True)
class QAReport:
    exact_match: float
    contains: float  # the generated text contains a gold answer
    n: int


def multidoc_qa(
    items: Sequence[QAItem], generate: GenerateFn, decode: Callable[[list[int]], str], max_tokens: int = 16
) -> QAReport:
    em, contains = [], []
    for it in items:
        text = normalize(decode(generate(it.prompt_ids, max_tokens)))
        gold = [normalize(a) for a in it.answers]
        em.append(any(text == g for g in gold))
        contains.append(any(g and g in text for g in gold))
    return QAReport(float(np.mean(em)), float(np.mean(contains)), len(items))


def accuracy(scores: Sequence[ProbeScore]) -> float:
    return float(np.mean([s.exact for s in scores])) if scores else float("nan")


# --- transformers adapters ----------------------------------------------------------------


def hf_score(model) -> ScoreFn:
    @torch.no_grad()
    def score(prompt_ids: list[int], cont_ids: list[int]) -> torch.Tensor:
        x = torch.tensor([list(prompt_ids) + list(cont_ids)])
        logits = model(input_ids=x).logits[0, len(prompt_ids) - 1 : x.shape[1] - 1].float()
        return torch.log_softmax(logits, -1)  # [len(cont), vocab]

    return score


def hf_generate(model, stop_ids: Sequence[int] = ()) -> GenerateFn:
    @torch.no_grad()
    def generate(prompt_ids: list[int], max_tokens: int) -> list[int]:
        out = model.generate(
            torch.tensor([list(prompt_ids)]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=list(stop_ids) or None,
            pad_token_id=model.config.pad_token_id,
        )
        return out[0, len(prompt_ids) :].tolist()

    return generate
