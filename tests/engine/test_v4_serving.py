"""DeepSeek-V4 through the engine (`LLM`, the pool, the scheduler, content reuse): the same answers as
its own full forward (which tests/model/test_deepseek_v4.py holds to transformers), and `pic` exact on
one layer for content reused at another position."""

import numpy as np
import pytest
import torch

from irminsul import LLM, RequestError
from irminsul.model.deepseek_v4 import CSA, HCA, SLIDING, TOPK_MOE, load_deepseek_v4, make_tiny_v4_checkpoint

pytest.importorskip("transformers", minversion="5.24")


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    return make_tiny_v4_checkpoint(tmp_path_factory.mktemp("v4") / "ckpt", seed=1)


def _rand(n, seed):
    return np.random.default_rng(seed).integers(0, 250, n).tolist()


def test_greedy_decode_equals_the_full_forward_and_batches_change_nothing(v4_dir):
    llm, model = LLM(v4_dir), load_deepseek_v4(v4_dir)
    ids = _rand(50, 0)
    seq = list(ids)
    for _ in range(8):
        seq.append(int(model.forward(torch.tensor(seq))[-1].argmax()))
    assert llm.generate(ids, max_tokens=8, ignore_eos=True).token_ids == seq[50:]
    logprobs = llm.score(ids[:40], ids[40:])
    assert (logprobs - model.forward(torch.tensor(ids))[39:49].log_softmax(-1)).abs().max().item() < 1e-4
    prompts = [ids, ids[:30], _rand(45, 1)]
    together = [r.token_ids for r in llm.generate(prompts, max_tokens=4, ignore_eos=True)]
    assert together == [llm.generate(p, max_tokens=4, ignore_eos=True).token_ids for p in prompts]


@pytest.mark.parametrize("kind", [HCA, CSA, SLIDING])
def test_pic_reuses_shifted_content_exactly_on_one_layer(tmp_path, kind):
    """A 300-token body cached behind a 40-token header and requested behind a 157-token one (shift 117,
    not a multiple of either rate): pic shares the cached rows and scores exactly as full prefill;
    naive (stale keys) does not."""
    # a 64-token window: the scored queries read reused keys through it, not only computed ones
    path = make_tiny_v4_checkpoint(
        tmp_path / "one", seed=2, num_hidden_layers=1, layer_types=[kind], mlp_layer_types=[TOPK_MOE], sliding_window=64
    )
    body = _rand(300, 3)
    first, second = _rand(40, 4) + body, _rand(157, 5) + body + _rand(5, 6)
    ref = LLM(path).score(second[:-3], second[-3:])
    for mode, exact in (("pic", True), ("naive", False)):
        llm = LLM(path, reuse=mode)
        llm.generate(first, max_tokens=1)
        got = llm.score(second[:-3], second[-3:])
        assert llm.last_stats.reused_tokens >= 150, llm.last_stats  # (CDC chunks of the body)
        err = (got - ref).abs().max().item()
        assert err < 1e-4 if exact else err > 1e-2, (mode, err)


def test_what_v4_cannot_do_yet_is_refused_clearly(v4_dir):
    with pytest.raises(RequestError, match="pic\\+r"):
        LLM(v4_dir, reuse="pic", recompute_ratio=0.2)
    with pytest.raises(Exception, match="its own reference attention only"):
        LLM(v4_dir, attention_backend="triton")


def test_the_server_serves_v4_with_reuse(v4_dir):
    """`irminsul serve --model <v4 checkpoint> --reuse pic`: completions and chat over HTTP (the official
    client), and a second request behind another header reuses the first's content."""
    openai = pytest.importorskip("openai")
    from tests.server.server_helpers import metric, start, text

    server = start(v4_dir, reuse="pic")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        body = text(80, 7)
        first = client.completions.create(model="tiny", prompt="header one. " + body, max_tokens=4, temperature=0)
        assert first.usage.completion_tokens >= 1
        client.completions.create(
            model="tiny", prompt="a longer, different header. " + body, max_tokens=4, temperature=0
        )
        assert metric(server.url, "irminsul_reused_tokens_total") > 100
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": body}], max_tokens=3, temperature=0
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
    finally:
        server.stop()


def test_the_mla_evaluations_refuse_v4_with_a_pointer(v4_dir, capsys):
    from irminsul.cli import main

    assert main(["eval", "rotation", "--model", str(v4_dir), "--n", "1"]) != 0
    assert "benchmarks/v4_reuse.py" in capsys.readouterr().err
