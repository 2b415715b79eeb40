"""The quality runner on a one-layer model, where theory says pic is exact and naive is not."""

import numpy as np
import pytest

from irminsul import LLM
from irminsul.model.tiny import make_tiny_checkpoint
from irminsul.research.eval.quality import STRATEGIES, QualityRunner, result
from irminsul.research.eval.tasks import ShiftedCase


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("q1") / "m", num_hidden_layers=1, first_k_dense_replace=1, yarn=True, std=0.3
    )


def _case(seed, depth=40, delta=117):
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(0, 250, n).tolist()  # noqa: E731
    shared, question = ids(500), ids(12)
    first = [256] + ids(depth) + shared
    prompt = [256] + ids(depth + delta) + shared + question
    return ShiftedCase("niah", first, prompt, ids(6), depth, delta, len(shared))


def test_pic_is_exact_on_one_layer_and_naive_is_not(one_layer):
    runner = QualityRunner(
        LLM(one_layer), [s for s in STRATEGIES if s.name in ("off", "prefix", "naive", "pic")], greedy_tokens=6
    )
    runner.run({"niah": [_case(0), _case(1, delta=-30)]}, progress=False)
    res = result(runner).to_json()
    per = res["tasks"]["niah"]
    assert per["off"]["kl_mean"] == 0 and per["off"]["reused_fraction"] == 0
    assert per["prefix"]["kl_mean"] < 1e-9  # a different header: nothing beyond BOS to reuse
    assert per["pic"]["content_reused_fraction"] > 0.5 and per["naive"]["content_reused_fraction"] > 0.5
    assert per["pic"]["kl_mean"] < 1e-6 and per["pic"]["argmax_agreement"] == 1.0
    assert per["pic"]["first_divergence"] == 6 and per["pic"]["accuracy"] == per["off"]["accuracy"]
    assert per["naive"]["kl_mean"] > 1e-4  # stale k_r
    for key in ("kl_mean", "kl_p95", "argmax_agreement", "first_divergence", "accuracy", "reused_fraction"):
        assert key in per["pic"]
    assert res["targets"]["niah"]["kl_reduction_pic_vs_naive"]["met"]
    assert res["sweep"]["niah"]["delta"]


def test_registering_first_equals_generating_it(one_layer):
    """The runner registers the prefilled first context instead of calling generate(first)."""
    case = _case(3)
    runner = QualityRunner(LLM(one_layer), [s for s in STRATEGIES if s.name == "naive"], greedy_tokens=2)
    runner.run({"niah": [case]}, progress=False)
    llm = LLM(one_layer, reuse="naive")
    llm.generate(case.first, max_tokens=1)
    lp = llm.score(case.prompt, case.answer)
    ref = LLM(one_layer).score(case.prompt, case.answer)
    from irminsul.research.eval.metrics import kl_per_token

    got = runner.scores["niah"]["naive"][0]
    assert got.reused_tokens == llm.last_stats.reused_tokens > 0
    assert np.allclose(got.kl, kl_per_token(ref, lp).numpy(), rtol=1e-4, atol=1e-9)
