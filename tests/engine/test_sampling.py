"""The batched sampler: the right distribution, randomness fixed by (seed, step) whatever the batch."""

import torch

from irminsul.engine.sampling import SamplingParams, sample_batch, uniforms


def _counts(logits, params, n=4000):
    rows = logits.expand(n, -1)
    tokens = sample_batch(rows, [params] * n, list(range(n)), [3] * n)
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / n


def test_samples_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    freq = _counts(logits, SamplingParams(temperature=0.7))
    want = (logits[0] / 0.7).softmax(-1)
    assert (freq - want).abs().max() < 0.03, (freq, want)  # 4,000 draws: the std of a share is <= 0.008


def test_top_k_top_p_and_min_p_cut_the_support():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -1.0]])
    probs = logits[0].softmax(-1)
    assert set(_counts(logits, SamplingParams(temperature=1.0, top_k=2)).nonzero().flatten().tolist()) == {0, 1}
    # top_p: the smallest prefix of the sorted distribution whose mass reaches p
    keep = int((probs.cumsum(0) < 0.8).sum()) + 1
    got = _counts(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert set(got.nonzero().flatten().tolist()) == set(range(keep))
    assert (got[:keep] - probs[:keep] / probs[:keep].sum()).abs().max() < 0.03  # renormalised over the kept
    got = _counts(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert set(got.nonzero().flatten().tolist()) == {i for i in range(6) if probs[i] >= 0.3 * probs[0]}


def test_randomness_is_a_function_of_seed_and_step_only():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    params = [SamplingParams(temperature=1.0)] * 5
    seeds, steps = [11, 12, 13, 14, 15], [0, 4, 4, 9, 1]
    together = sample_batch(logits, params, seeds, steps)
    alone = [
        int(sample_batch(logits[i : i + 1], params[i : i + 1], seeds[i : i + 1], steps[i : i + 1])[0]) for i in range(5)
    ]
    assert together.tolist() == alone
    greedy = SamplingParams(temperature=0.0)
    mixed = sample_batch(logits, [greedy, *params[1:]], seeds, steps)  # a greedy neighbour changes nothing
    assert mixed[0] == logits[0].argmax() and mixed[1:].tolist() == together[1:].tolist()
    u = uniforms(torch.tensor([7, 7, 8]), torch.tensor([0, 1, 0]), 1000)
    assert ((u > 0) & (u < 1)).all() and abs(u.mean().item() - 0.5) < 0.02
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u, uniforms(torch.tensor([7, 7, 8]), torch.tensor([0, 1, 0]), 1000))
