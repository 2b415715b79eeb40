import numpy as np
import pytest

from irminsul.research.train import tasks


def _sub(seq, sub):
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.parametrize("n", [128, 512])
def test_passkey_answer_is_the_needle_value(tok, pool, n):
    ex = tasks.passkey(pool, np.random.default_rng(0), n, depth=0.3, value="48213")
    assert tok.decode(ex.answer_ids[: ex.answer_len]) == " 48213"
    assert ex.answer_ids[-1] == tok.token_to_id("<|end|>")
    assert _sub(ex.prompt_ids, tok.encode(" The passkey is 48213").ids)
    assert abs(len(ex.ids) - n) <= 2
    assert tok.decode(ex.prompt_ids).endswith("The passkey is")


def test_kv_answer_is_the_value_of_the_asked_key(tok, pool):
    for seed in range(5):
        ex = tasks.kv(pool, np.random.default_rng(seed), 256)
        text = tok.decode(ex.prompt_ids)
        key = text.rsplit("The code for ", 1)[1].split(" is")[0]
        value = tok.decode(ex.answer_ids[: ex.answer_len])
        assert f"The code for {key} is{value}." in text


def test_doc_qa_answer_follows_the_quote(pool):
    ex = tasks.doc_qa(pool, np.random.default_rng(0), 400, quote_len=6, answer_len=3)
    assert ex.answer_len == 3
    assert _sub(ex.prompt_ids, ex.answer_ids[:3])


def test_tool_answer_owns_the_parameter(tok, pool):
    ex = tasks.tool(pool, np.random.default_rng(1), 200)
    text = tok.decode(ex.prompt_ids)
    name = tok.decode(ex.answer_ids[: ex.answer_len])
    param = text.rsplit('parameter "', 1)[1].split('"')[0]
    assert name == "tool_" + param[1:]


def test_examples_are_deterministic_in_the_rng(pool):
    a = tasks.sample_example(pool, np.random.default_rng(7), 300, {"passkey": 1, "kv": 1})
    b = tasks.sample_example(pool, np.random.default_rng(7), 300, {"passkey": 1, "kv": 1})
    assert a == b


def test_repeat_continues_a_span_of_the_haystack(pool):
    ex = tasks.repeat(pool, np.random.default_rng(3), 300)
    span = ex.prompt_ids[-6:] + ex.answer_ids[: ex.answer_len]
    assert _sub(ex.prompt_ids[:-6], span)


@pytest.mark.parametrize("kind", ["passkey", "kv", "doc_qa", "repeat", "copy"])
def test_sources_point_at_the_copied_tokens(pool, kind):
    for seed in range(10):
        ex = tasks.BUILDERS[kind](pool, np.random.default_rng(seed), 300)
        assert ex.sources is not None and len(ex.sources) == ex.answer_len
        assert [ex.prompt_ids[i] for i in ex.sources] == ex.answer_ids[: ex.answer_len]
