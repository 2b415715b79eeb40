"""Synthetic retrieval tasks built from real text: the model must attend far back to answer.

Every task returns an `Example`: `prompt_ids` (BOS, user turn with the haystack and the question,
assistant turn up to the answer) and `answer_ids` (the tokens to copy, then `<|end|>`). Question
and answer ids are built separately and concatenated, so the answer length is known exactly.
The same builders make the training data and the evaluation probes;
only the token pools differ (train vs held-out).

The needle is a clean key -> value lookup ("The passkey is 48213.") inside real filler, asked for
again with the same phrase at the end, so the answer is an induction pattern: find the earlier
"passkey is", copy what follows (a 2-layer model learns pure copying in ~300 steps; calibration).
"""

import json
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from irminsul.model.chat_format import BOS, END, ROLE_TOKENS, SPECIAL_TOKENS

KINDS = ("passkey", "kv", "doc_qa", "tool", "repeat", "copy")


@dataclass(frozen=True)
class Example:
    prompt_ids: list[int]
    answer_ids: list[int]  # ends with <|end|>; `answer_len` excludes it
    kind: str
    # prompt index each answer token was copied from (len == answer_len), where the task knows it;
    # the trainer's attention supervision uses it (train/attention.py)
    sources: tuple[int, ...] | None = None

    @property
    def answer_len(self) -> int:
        return len(self.answer_ids) - 1

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids


class TokenPool:
    """Tokenised documents of one split; samples filler spans free of special tokens."""

    def __init__(self, tok: Tokenizer, docs: dict[str, list[str]], tools: list[dict], words: list[str]):
        self.tok = tok
        specials = {tok.token_to_id(t) for t in SPECIAL_TOKENS}
        self.docs = {
            src: [np.array([i for i in e.ids if i not in specials], dtype=np.int32) for e in tok.encode_batch(texts)]
            for src, texts in docs.items()
        }
        self.filler_docs = [d for ds in self.docs.values() for d in ds if len(d) >= 32]
        self.passages = [d for d in self.docs.get("musique", []) if len(d) >= 64]
        self.tools = tools
        counts = np.bincount(np.concatenate(self.filler_docs), minlength=tok.get_vocab_size())
        numbers = [i for t, i in tok.get_vocab().items() if t.lstrip("Ġ").isdigit()]
        frequent = np.argsort(-counts)[: 1024 - len(numbers)]
        self.copy_vocab = np.array(sorted(set(frequent.tolist()) | set(numbers) - specials), dtype=np.int64)
        self.words = words
        self._cache: dict[str, list[int]] = {}

    def enc(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = self.tok.encode(text).ids
        return self._cache[text]

    def filler(self, rng: np.random.Generator, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            d = self.filler_docs[rng.integers(len(self.filler_docs))]
            start = int(rng.integers(0, max(1, len(d) - 16)))
            out += d[start : start + n - len(out)].tolist() + self.enc("\n\n")
        return out[:n]


def _digits(rng: np.random.Generator, n: int) -> str:
    return str(int(rng.integers(1, 10))) + "".join(str(int(d)) for d in rng.integers(0, 10, n - 1))


BODY_AT = 2  # the body starts after BOS and <|user|>


def _turn(t: Tokenizer, user: list[int], assistant: list[int]) -> list[int]:
    """One user turn, then the assistant's reply begun: `<|bos|><|user|>user<|end|><|assistant|>assistant`."""
    return (
        [t.token_to_id(BOS), t.token_to_id(ROLE_TOKENS["user"])]
        + user
        + [t.token_to_id(END), t.token_to_id(ROLE_TOKENS["assistant"])]
        + assistant
    )


def _wrap(
    pool: TokenPool,
    body: list[int],
    question: str,
    prefix: str,
    answer: list[int],
    kind: str,
    body_sources: list[int] | None = None,
) -> Example:
    t = pool.tok
    prompt = _turn(t, body + pool.enc(question), pool.enc(prefix))
    sources = tuple(BODY_AT + i for i in body_sources) if body_sources is not None else None
    return Example(prompt, answer + [t.token_to_id(END)], kind, sources)


def _insert(filler: list[int], needles: list[list[int]], depths: list[float]) -> tuple[list[int], list[int]]:
    """Splice needles into filler at relative depths in [0, 1]; returns (body, start of each needle)."""
    out: list[int] = []
    starts = [0] * len(needles)
    prev = 0
    for i in sorted(range(len(needles)), key=lambda i: depths[i]):
        at = int(round(depths[i] * len(filler)))
        out += filler[prev:at]
        prev = at
        starts[i] = len(out)
        out += needles[i]
    return out + filler[prev:], starts


def passkey(
    pool: TokenPool,
    rng: np.random.Generator,
    n_tokens: int,
    depth: float | None = None,
    n_digits: int | None = None,
    value: str | None = None,
) -> Example:
    value = value or _digits(rng, n_digits or int(rng.integers(3, 8)))
    v = pool.enc(" " + value)  # the same ids in the needle and in the answer
    lead = pool.enc(" The passkey is")
    needle = lead + v + pool.enc(". Remember it. ")
    question, prefix = "\n\nWhat is the passkey?", "The passkey is"
    fixed = 4 + len(needle) + len(pool.enc(question)) + len(pool.enc(prefix)) + len(v) + 1
    filler = pool.filler(rng, max(8, n_tokens - fixed))
    depth = float(rng.random()) if depth is None else depth
    body, (at,) = _insert(filler, [needle], [depth])
    return _wrap(pool, body, question, prefix, v, "passkey", [at + len(lead) + i for i in range(len(v))])


def kv(pool: TokenPool, rng: np.random.Generator, n_tokens: int) -> Example:
    """Several "The code for <word> is <digits>." needles; the question names one key."""
    m = int(rng.integers(2, 7))
    keys = [pool.words[i] for i in rng.choice(len(pool.words), m, replace=False)]
    values = [pool.enc(" " + _digits(rng, int(rng.integers(3, 8)))) for _ in keys]
    leads = [pool.enc(f" The code for {k} is") for k in keys]
    needles = [lead + v + pool.enc(". ") for lead, v in zip(leads, values)]
    j = int(rng.integers(m))
    question, prefix = f"\n\nWhat is the code for {keys[j]}?", f"The code for {keys[j]} is"
    fixed = 4 + sum(map(len, needles)) + len(pool.enc(question)) + len(pool.enc(prefix)) + len(values[j]) + 1
    filler = pool.filler(rng, max(8, n_tokens - fixed))
    body, starts = _insert(filler, needles, rng.random(m).tolist())
    return _wrap(
        pool, body, question, prefix, values[j], "kv", [starts[j] + len(leads[j]) + i for i in range(len(values[j]))]
    )


def doc_qa(
    pool: TokenPool, rng: np.random.Generator, n_tokens: int, quote_len: int = 8, answer_len: int = 4
) -> Example:
    """N MuSiQue passages as "Document [i]: ..."; quote a span of one, answer with what follows it."""
    budget = max(64, n_tokens - 40)
    n_docs = int(rng.integers(2, 11))
    per_doc = max(48, budget // n_docs - 6)
    body: list[int] = []
    spans, text_at = [], []
    for i in range(n_docs):
        d = pool.passages[rng.integers(len(pool.passages))]
        start = int(rng.integers(0, max(1, len(d) - per_doc)))
        text = d[start : start + per_doc].tolist()
        spans.append(text)
        body += pool.enc(f"Document [{i + 1}]: ")
        text_at.append(len(body))
        body += text + pool.enc("\n")
        if len(body) >= budget:
            break
    k = int(rng.integers(len(spans)))
    text = spans[k]
    s = int(rng.integers(0, max(1, len(text) - quote_len - answer_len)))
    quote, answer = text[s : s + quote_len], text[s + quote_len : s + quote_len + answer_len]
    t = pool.tok
    q_ids = pool.enc('\n\nWhich words follow "') + quote + pool.enc('"?')
    prompt = _turn(t, body + q_ids, pool.enc("They are:"))
    at = BODY_AT + text_at[k] + s + quote_len
    return Example(prompt, answer + [t.token_to_id(END)], "doc_qa", tuple(range(at, at + len(answer))))


def tool(pool: TokenPool, rng: np.random.Generator, n_tokens: int) -> Example:
    """Tool schemas as JSON lines; which tool takes parameter X (X unique among those shown)."""
    body: list[int] = []
    shown: list[dict] = []
    while len(body) < n_tokens - 48:
        s = pool.tools[rng.integers(len(pool.tools))]
        ids = pool.enc(json.dumps(s, ensure_ascii=False)) + pool.enc("\n")
        if len(body) + len(ids) > n_tokens - 48 and shown:
            break
        body += ids[: n_tokens - 48]
        shown.append(s)
    counts: dict[str, int] = {}
    for s in shown:
        for p in _params(s):
            counts[p] = counts.get(p, 0) + 1
    choices = [(s, p) for s in shown for p in _params(s) if counts[p] == 1]
    if not choices:
        return passkey(pool, rng, n_tokens)
    s, p = choices[rng.integers(len(choices))]
    return _wrap(pool, body, f'\n\nWhich tool takes the parameter "{p}"?', 'The tool is "', pool.enc(s["name"]), "tool")


def repeat(pool: TokenPool, rng: np.random.Generator, n_tokens: int) -> Example:
    """A span of real text hidden in filler; the assistant starts it and must continue it.

    Pure induction with many supervised tokens per example (8-24), the mechanism every other task
    here needs (Olsson et al. 2022, "In-context learning and induction heads").
    """
    d = pool.filler_docs[rng.integers(len(pool.filler_docs))]
    m = int(rng.integers(8, 25))
    start = int(rng.integers(0, max(1, len(d) - m - 6)))
    span = d[start : start + 6 + m].tolist()
    head, answer = span[:6], span[6:]
    question = "\n\nContinue the text that begins as follows."
    fixed = 4 + 2 * len(span) + len(pool.enc(question)) + 1
    filler = pool.filler(rng, max(8, n_tokens - fixed))
    body, (at,) = _insert(filler, [span], [float(rng.random())])
    t = pool.tok
    prompt = _turn(t, body + pool.enc(question), head)
    at += BODY_AT + len(head)
    return Example(prompt, answer + [t.token_to_id(END)], "repeat", tuple(range(at, at + len(answer))))


def copy(pool: TokenPool, rng: np.random.Generator, n_tokens: int) -> Example:
    """A span of random tokens hidden in filler, then repeated: every token after the second one
    is supervised and predictable only by copying. This forms induction heads within a few
    hundred steps, which the retrieval tasks then reuse. The tokens come from `copy_vocab` (the
    frequent tokens and every number piece): with spans drawn from all 8k tokens, MLA in
    transformers stayed at chance for 250 steps where Llama learned; with 512 tokens it copied
    within 150 steps."""
    m = int(rng.integers(16, 49))
    span = pool.copy_vocab[rng.integers(0, len(pool.copy_vocab), m)].tolist()
    question = "\n\nRepeat the random text."
    fixed = 4 + 2 * m + len(pool.enc(question)) + 1
    # a short gap only: with up to 200 tokens of filler (whose frequent tokens collide with the
    # span's) no copying emerged in 300 steps; distance is what the other tasks teach
    gap = int(rng.integers(0, max(1, min(64, n_tokens - fixed))))
    body = pool.filler(rng, gap // 2) + span + pool.filler(rng, gap - gap // 2)
    t = pool.tok
    prompt = _turn(t, body + pool.enc(question), span[:2])
    at = BODY_AT + gap // 2 + 2
    return Example(prompt, span[2:] + [t.token_to_id(END)], "copy", tuple(range(at, at + m - 2)))


def _params(schema: dict) -> list[str]:
    props = (schema.get("parameters") or {}).get("properties") or {}
    return list(props) if isinstance(props, dict) else []


BUILDERS = {"passkey": passkey, "kv": kv, "doc_qa": doc_qa, "tool": tool, "repeat": repeat, "copy": copy}


def sample_example(pool: TokenPool, rng: np.random.Generator, n_tokens: int, mix: dict[str, float]) -> Example:
    kinds = list(mix)
    p = np.array([mix[k] for k in kinds], dtype=float)
    kind = kinds[rng.choice(len(kinds), p=p / p.sum())]
    return BUILDERS[kind](pool, rng, n_tokens)
