"""The sampler where users are: vocabularies up to 160k, any valid parameters, any mask.

A chosen token always has probability > 0 under what the request asked for (its mask, top-k,
top-p, min-p), and sampled frequencies match the distribution (chi-square over 10^6 draws).
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from irminsul.engine.sampling import (
    SamplingParams,
    _uniforms_blocked,
    _uniforms_whole,
    sample_batch,
    uniforms,
    unit_interval,
)

DEEPSEEK_VOCAB = 129_280


def chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """P(X >= the statistic) for X ~ chi-square with len - 1 degrees of freedom."""
    stat = ((counts - expected) ** 2 / expected).sum().double()
    df = torch.tensor(float(len(counts) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def test_every_hash_value_maps_inside_the_open_unit_interval():
    # all 2^23 values of the bits that are kept, each with the dropped low bits all ones (the
    # largest number that maps there): none reaches 0 or 1, so -log(U) is finite and > 0
    top = np.arange(1 << 23, dtype=np.uint64) << np.uint64(41) | np.uint64((1 << 41) - 1)
    u = unit_interval(torch.from_numpy(top.view(np.int64)))
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    e = -torch.log(u)
    assert bool((e > 0).all()) and bool(torch.isfinite(e).all())
    assert torch.unique(u).numel() == 1 << 23  # no two patterns collapse onto one float


@pytest.mark.parametrize(
    "rows, vocab", [(1, DEEPSEEK_VOCAB), (3, 70_000), (5, 1), (1000, 100), (20_000, 12), (2, (1 << 16) + 1)]
)
def test_the_cpu_hash_in_blocks_gives_the_same_numbers_as_the_whole_at_once(rows, vocab):
    seeds = torch.arange(rows) * 7919 - 2**61  # negative seeds and wrapping products too
    steps = torch.arange(rows) * 3 + 2**40
    assert torch.equal(_uniforms_blocked(seeds, steps, vocab), _uniforms_whole(seeds, steps, vocab))


def test_uniforms_at_a_deepseek_vocabulary_are_uniform():
    u = uniforms(torch.arange(8), torch.zeros(8, dtype=torch.long), DEEPSEEK_VOCAB).flatten().double()  # ~10^6
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    srt = u.sort().values
    n = srt.numel()
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    d = float(torch.maximum(grid - srt, srt - (grid - 1 / n)).max())  # Kolmogorov-Smirnov statistic
    assert d < 1.95 / math.sqrt(n), d  # the 0.1% critical value


def test_no_token_outside_top_k_at_a_deepseek_vocabulary():
    # ~0.8% of rows of this size held a uniform that rounded to 1.0, a 0/0 race that chose a token
    # of probability 0; 640 rows meet several of them
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, DEEPSEEK_VOCAB, generator=g)
    logits[0, 7], logits[0, 70_000] = 12.0, 11.5  # the top two hold almost all the mass among themselves
    params = SamplingParams(temperature=1.0, top_k=2)
    counts = torch.zeros(DEEPSEEK_VOCAB)
    for start in range(0, 640, 128):
        rows = logits.expand(128, -1)
        tokens = sample_batch(rows, [params] * 128, list(range(start, start + 128)), [5] * 128)
        counts += torch.bincount(tokens, minlength=DEEPSEEK_VOCAB).float()
    assert set(counts.nonzero().flatten().tolist()) == {7, 70_000}
    p7 = 1 / (1 + math.exp(-0.5))
    expected = torch.tensor([p7, 1 - p7]) * 640
    assert chi2_pvalue(counts[[7, 70_000]], expected) > 1e-3


def test_a_grammar_mask_is_never_crossed_at_a_deepseek_vocabulary():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, DEEPSEEK_VOCAB, generator=g) * 3
    allowed = torch.zeros(DEEPSEEK_VOCAB, dtype=torch.bool)
    allowed[torch.randint(0, DEEPSEEK_VOCAB, (5,), generator=g)] = True
    masked = logits.masked_fill(~allowed, float("-inf"))
    for start in range(0, 384, 64):
        tokens = sample_batch(masked, [SamplingParams(temperature=1.0)] * 64, list(range(start, start + 64)), [0] * 64)
        assert bool(allowed[tokens].all())


def test_frequencies_match_the_distribution_over_a_million_draws():
    logits = torch.tensor([[1.5, 1.0, 0.2, -0.3, -1.0, 0.7, float("-inf"), -2.0, 0.0, 2.2, float("-inf"), -0.5]])
    n = 1_000_000
    for params in (
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.2),
    ):
        want = torch.from_numpy(reference_probs(logits[0].numpy(), params))
        tokens = sample_batch(logits.expand(n, -1), [params] * n, list(range(n)), [3] * n)
        counts = torch.bincount(tokens, minlength=logits.shape[-1]).double()
        keep = want > 0
        assert counts[~keep].sum() == 0, (params, counts)
        assert chi2_pvalue(counts[keep], want[keep] * n) > 1e-4, (params, counts, want * n)


def reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution the request asked for, in float64: temperature, then top-k, min-p, top-p
    (the same order and rules as vLLM's), renormalised."""
    x = logits.astype(np.float64) / params.temperature
    order = np.argsort(-x, kind="stable")
    srt = x[order]
    if params.top_k:
        srt[params.top_k :] = -np.inf
    p = np.exp(srt - srt.max())
    p /= p.sum()
    drop = (p < params.min_p * p[0]) | (np.cumsum(p) - p >= params.top_p)
    drop[0] = False
    p[drop] = 0
    out = np.zeros_like(p)
    out[order] = p / p.sum()
    return out


@st.composite
def sampling_cases(draw):
    vocab = draw(st.sampled_from([2, 3, 17, 1000, 32_000, DEEPSEEK_VOCAB, 160_000]))
    batch = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32))
    params = [
        SamplingParams(
            temperature=draw(st.floats(1e-5, 100.0)),
            top_k=draw(st.one_of(st.just(0), st.integers(1, vocab + 5), st.just(2**63), st.just(10**30))),
            top_p=draw(st.floats(1e-6, 1.0, exclude_min=False)),
            min_p=draw(st.floats(0.0, 1.0)),
            seed=draw(st.integers(0, 2**63 - 1)),
        )
        for _ in range(batch)
    ]
    masked_share = draw(st.sampled_from([0.0, 0.5, 0.999]))
    return vocab, seed, params, masked_share, draw(st.integers(0, 10_000))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(case=sampling_cases())
def test_the_chosen_token_has_probability_above_zero(case):
    vocab, seed, params, masked_share, step = case
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), vocab, generator=g) * 4
    mask = torch.rand(len(params), vocab, generator=g) < masked_share
    mask[torch.arange(len(params)), torch.randint(0, vocab, (len(params),), generator=g)] = False  # one allowed
    logits = logits.masked_fill(mask, float("-inf"))
    tokens = sample_batch(logits, params, [p.seed for p in params], [step] * len(params))
    for row, (token, p) in enumerate(zip(tokens.tolist(), params)):
        assert not bool(mask[row, token]), "a masked token was chosen"
        x = logits[row].double() / (1.0 if p.greedy else p.temperature)
        if p.greedy:
            assert x[token] == x.max()
            continue
        # top-k counts ranks: at most top_k - 1 tokens may beat the chosen one
        if p.top_k:
            assert int((x > x[token]).sum()) < p.top_k
        probs = torch.softmax(x, -1)
        # min-p and top-p, with a float32 margin: the sampler computes them in float32
        assert probs[token] >= p.min_p * probs.max() * (1 - 1e-4) - 1e-12
        before = probs[x > x[token]].sum()
        assert before < p.top_p + 1e-4
