"""Evaluate a reference checkpoint: held-out loss per source, needle recall, multi-document QA.

Every number is computed through the callables of `retrieval.py`, once with transformers and,
with `engine=True`, once more with our engine (`irminsul.LLM`, reuse off), so that a decoding bug
cannot pass for a model that failed to learn.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from irminsul.data import data_dir
from irminsul.model.chat_format import BOS, END
from irminsul.research.train import retrieval, tasks
from irminsul.research.train.checkpoint import load_checkpoint
from irminsul.research.train.data import Corpus, is_held_out, musique_items
from irminsul.research.train.tokenizer import load_tokenizer


@torch.no_grad()
def held_out_loss(
    model, pool: tasks.TokenPool, bos: int, window: int = 1024, max_windows: int = 32
) -> dict[str, float]:
    """Mean next-token loss per source over non-overlapping windows of the held-out documents."""
    out = {}
    for src, docs in pool.docs.items():
        stream = np.concatenate([np.concatenate([[bos], d]) for d in docs]).astype(np.int64)
        n = min(max_windows, (len(stream) - 1) // window)
        if n == 0:
            continue
        nll = []
        for i in range(n):
            w = torch.from_numpy(stream[i * window : i * window + window + 1])[None]
            logits = model(input_ids=w[:, :-1]).logits.float()
            nll.append(float(F.cross_entropy(logits[0], w[0, 1:])))
        out[src] = float(np.mean(nll))
    return out


def evaluate(
    model_dir: Path,
    engine: bool = False,
    n_needles: int = 4,
    qa_items: int = 120,
    doc_qa_n: int = 20,
    data: str | None = None,
    seed: int = 0,
    loss_windows: int = 32,
    log=lambda line: tqdm.write(line, file=sys.stderr),
) -> dict:
    model_dir = Path(model_dir)
    tok = load_tokenizer(model_dir)
    corpus = Corpus.load(data)
    held = tasks.TokenPool(tok, corpus.held_out, corpus.tools_held_out, corpus.words)
    end = tok.token_to_id(END)
    t0 = time.time()
    impls = {"transformers": load_checkpoint(model_dir)}
    fns = {
        "transformers": (retrieval.hf_score(impls["transformers"]), retrieval.hf_generate(impls["transformers"], [end]))
    }
    if engine:
        from irminsul import LLM

        llm = LLM(model=model_dir, reuse="off")
        fns["engine"] = (llm.score, lambda p, n: llm.generate(p, max_tokens=n, stop_token_ids=(end,)).token_ids)

    needles = retrieval.needle_examples(held, per_depth=n_needles, seed=seed)
    items = musique_items(data_dir(data))[:qa_items]
    held_q = [i for i, it in enumerate(items) if is_held_out(it["question"])]
    # one bar over every model call: each needle is generated and scored, 9 synthetic sets, QA twice
    calls = 2 * len(needles) + 9 * doc_qa_n + len(items) + len(held_q)
    bar = tqdm(total=calls * len(fns), desc="eval-reference", unit="call", mininterval=2)
    fns = {name: _counted(score, bar) + _counted(gen, bar) for name, (score, gen) in fns.items()}

    res = {"model": str(model_dir), "seed": seed}
    res["held_out_loss"] = held_out_loss(impls["transformers"], held, tok.token_to_id(BOS), max_windows=loss_windows)
    log(f"held-out loss per source: {res['held_out_loss']}")

    rng = np.random.default_rng(seed + 1)
    synth = {
        f"{kind}@{n}": [tasks.BUILDERS[kind](held, rng, n) for _ in range(doc_qa_n)]
        for kind in ("kv", "doc_qa", "tool")
        for n in (512, 1024, 2048)
    }
    qa = retrieval.musique_prompts(tok, items)
    for name, (score, generate) in fns.items():
        rep = retrieval.needle_recall(needles, generate, score)
        res[f"needle/{name}"] = {"recall": rep.recall, "logprob": rep.logprob, "n": rep.n}
        log(f"[{name}] needle recall: {rep.row()}")
        for key, exs in synth.items():
            s = retrieval.score_examples(score, exs)
            res.setdefault(f"synthetic/{name}", {})[key] = {
                "accuracy": retrieval.accuracy(s),
                "logprob": float(np.mean([p.logprob for p in s])),
                "n": len(s),
            }
        log(
            f"[{name}] synthetic accuracy: "
            + " ".join(f"{k}={v['accuracy']:.2f}" for k, v in res[f"synthetic/{name}"].items())
        )
        dec = lambda ids: tok.decode([i for i in ids if i != end])  # noqa: E731
        full = retrieval.multidoc_qa(qa, generate, dec)
        sub = retrieval.multidoc_qa([qa[i] for i in held_q], generate, dec) if held_q else None
        res[f"musique/{name}"] = {
            "exact_match": full.exact_match,
            "contains": full.contains,
            "n": full.n,
            "held_out_exact_match": sub.exact_match if sub else None,
            "held_out_n": sub.n if sub else 0,
        }
        log(f"[{name}] MuSiQue QA: EM {full.exact_match:.3f}, contains {full.contains:.3f} (n={full.n})")
    bar.close()
    if engine:
        ex = needles[0]
        a = fns["transformers"][0](ex.prompt_ids, ex.answer_ids)
        b = fns["engine"][0](ex.prompt_ids, ex.answer_ids)
        res["engine_vs_transformers_max_abs_logprob_diff"] = float((a - b.float()).abs().max())
    res["eval_wall_s"] = round(time.time() - t0)
    return res


def _counted(fn, bar) -> tuple:
    """(fn, counting each call on the progress bar)"""

    def call(*args):
        out = fn(*args)
        bar.update()
        return out

    return (call,)


def save(res: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(res, indent=2) + "\n")
