"""Every metric on cases whose answer is known."""

import itertools
import math

import numpy as np
import pytest
import torch

from irminsul.research.eval import metrics


def _logp(probs):
    return torch.tensor(probs, dtype=torch.float64).log()


def test_kl_of_identical_distributions_is_zero():
    lp = torch.randn(7, 50).log_softmax(-1)
    assert metrics.kl_per_token(lp, lp).abs().max() == 0


def test_kl_matches_hand_computed_value_and_is_asymmetric():
    p, q = _logp([[0.5, 0.5]]), _logp([[0.9, 0.1]])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert metrics.kl_per_token(p, q).item() == pytest.approx(expected, rel=1e-12)
    assert metrics.kl_per_token(q, p).item() != pytest.approx(expected, rel=1e-3)


def test_kl_ignores_tokens_the_reference_gives_no_mass():
    p, q = _logp([[1.0, 0.0]]), _logp([[0.5, 0.5]])
    assert metrics.kl_per_token(p, q).item() == pytest.approx(math.log(2))


def test_argmax_agreement_and_first_divergence():
    ref = torch.eye(5)[[0, 1, 2, 3]].log_softmax(-1)
    cand = torch.eye(5)[[0, 1, 4, 3]].log_softmax(-1)
    assert metrics.argmax_agreement(ref, ref) == 1.0
    assert metrics.argmax_agreement(ref, cand) == 0.75
    assert metrics.first_divergence([0, 1, 2, 3], cand) == 2
    assert metrics.first_divergence([0, 1, 4, 3], cand) == 4
    assert metrics.exact([0, 1, 4, 3], cand) and not metrics.exact([0, 1, 2, 3], cand)


def test_auc_on_constructed_data():
    assert metrics.auc([2.0, 3.0, 4.0], [0.0, 1.0]) == 1.0  # separable
    assert metrics.auc([0.0, 1.0], [2.0, 3.0]) == 0.0  # reversed
    assert metrics.auc([1.0] * 5, [1.0] * 7) == 0.5  # all tied
    rng = np.random.default_rng(0)
    same = rng.normal(size=20000)
    assert metrics.auc(same[:10000], same[10000:]) == pytest.approx(0.5, abs=0.02)  # same distribution
    assert metrics.auc([1.0, 2.0], [1.0, 0.0]) == 0.875  # one tie counts one half: 3.5 / 4


def test_auc_equals_pairwise_definition_with_ties():
    rng = np.random.default_rng(1)
    pos, neg = rng.integers(0, 5, 40).astype(float), rng.integers(0, 5, 30).astype(float)
    brute = np.mean([1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg)])
    assert metrics.auc(pos, neg) == pytest.approx(brute, abs=1e-12)


def test_roc_curve_runs_from_origin_to_one():
    fpr, tpr = metrics.roc_curve([0.9, 0.8], [0.1, 0.2])
    assert (fpr[0], tpr[0]) == (0.0, 0.0) and (fpr[-1], tpr[-1]) == (1.0, 1.0)


def test_rel_l2_and_cosine():
    x = torch.tensor([3.0, 4.0])
    assert metrics.rel_l2(x, x) == 0.0
    assert metrics.rel_l2(torch.zeros(2), x) == pytest.approx(1.0)
    c = metrics.cosine_rows(torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[0.0, 2.0], [2.0, 2.0]]))
    assert c.tolist() == pytest.approx([0.0, 1.0])


def test_wilson_interval_known_values():
    w = metrics.wilson(5, 10)
    assert (w.value, round(w.low, 3), round(w.high, 3)) == (0.5, 0.237, 0.763)
    assert metrics.wilson(0, 20).low == 0.0 and metrics.wilson(20, 20).high == 1.0


def test_bootstrap_interval_brackets_the_mean_and_shrinks_with_n():
    rng = np.random.default_rng(0)
    small, large = metrics.bootstrap_ci(rng.normal(size=20)), metrics.bootstrap_ci(rng.normal(size=2000))
    assert small.low <= small.value <= small.high
    assert large.high - large.low < small.high - small.low
    assert metrics.p95(np.arange(101)) == 95.0
