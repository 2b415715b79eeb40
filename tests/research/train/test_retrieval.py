import math

import torch

from irminsul.research.train import retrieval


def _oracle(examples, vocab):
    """Fake engine that knows every answer: a perfect model."""
    answers = {tuple(e.prompt_ids): e.answer_ids for e in examples}

    def score(prompt, cont):
        lp = torch.full((len(cont), vocab), -20.0)
        lp[torch.arange(len(cont)), torch.tensor(answers[tuple(prompt)][: len(cont)])] = 0.0
        return lp

    def generate(prompt, max_tokens):
        return answers[tuple(prompt)][:max_tokens]

    return score, generate


def test_needle_recall_of_an_oracle_is_one_and_of_a_liar_is_zero(tok, pool):
    exs = retrieval.needle_examples(pool, lengths=(512,), depths=(0.1, 0.9), per_depth=2)
    score, generate = _oracle(exs, tok.get_vocab_size())
    rep = retrieval.needle_recall(exs, generate, score)
    assert rep.recall == {512: 1.0} and rep.n == {512: 4} and rep.logprob[512] == 0.0
    liar = retrieval.needle_recall(exs, lambda p, n: [tok.token_to_id("1")] * n)
    assert liar.recall == {512: 0.0} and math.isnan(liar.logprob[512])


def test_score_examples_marks_exact_only_when_every_token_is_argmax(tok, pool):
    exs = retrieval.needle_examples(pool, lengths=(512,), depths=(0.5,), per_depth=1)
    score, _ = _oracle(exs, tok.get_vocab_size())

    def off_by_one(prompt, cont):
        lp = score(prompt, cont)
        return lp.roll(1, dims=0)

    assert retrieval.score_examples(score, exs)[0].exact
    assert not retrieval.score_examples(off_by_one, exs)[0].exact


def test_multidoc_qa_normalises_answers(tok):
    items = [
        {
            "ctxs": [{"title": "", "text": "echo delta golf"}, {"title": "", "text": "alpha bravo"}],
            "question": "which?",
            "answers": ["Alpha Bravo"],
        }
    ]
    qa = retrieval.musique_prompts(tok, items, max_tokens=200)
    text = tok.decode(qa[0].prompt_ids)
    assert text.index("alpha bravo") < text.index("echo delta")  # gold passage first
    right = retrieval.multidoc_qa(qa, lambda p, n: tok.encode(" the alpha bravo.").ids, tok.decode)
    wrong = retrieval.multidoc_qa(qa, lambda p, n: tok.encode(" echo").ids, tok.decode)
    assert (right.exact_match, right.contains, wrong.exact_match) == (1.0, 1.0, 0.0)


def test_hf_adapters_agree_with_each_other(tok, pool, tiny_mla):
    exs = retrieval.needle_examples(pool, lengths=(256,), depths=(0.5,), per_depth=1)
    ex = exs[0]
    lp = retrieval.hf_score(tiny_mla)(ex.prompt_ids, ex.answer_ids)
    assert lp.shape == (len(ex.answer_ids), tiny_mla.config.vocab_size)
    assert torch.allclose(lp.exp().sum(-1), torch.ones(len(ex.answer_ids)), atol=1e-4)
    gen = retrieval.hf_generate(tiny_mla)(ex.prompt_ids, 3)
    first = int(retrieval.hf_score(tiny_mla)(ex.prompt_ids, gen[:1])[0].argmax())
    assert gen[0] == first
