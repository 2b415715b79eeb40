"""logit_bias: at most MAX_LOGIT_BIAS entries, counted before any is read, and applied as tensors
built once per request, with the per-entry loop's exact result."""

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from irminsul.engine.sampling import MAX_LOGIT_BIAS, SamplingParams, adjust_logits
from irminsul.errors import RequestError


def slow_bias(logits: torch.Tensor, bias) -> torch.Tensor:
    """The reference: each (id, bias) pair added in turn, ids outside the vocabulary skipped."""
    logits = logits.float().clone()
    for token, value in bias:
        if 0 <= token < logits.shape[-1]:
            logits[token] += value
    return logits


def test_the_bias_tensors_give_the_per_entry_loops_result_exactly():
    """Random biases of every size up to the bound, repeated ids (added one at a time, in order, as
    the loop adds them), negative and out-of-vocabulary ids (skipped), logits of any scale."""
    rng = random.Random(0)
    for _ in range(200):
        vocab = rng.choice([7, 320, 8192])
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        logits *= rng.choice([1.0, 30.0, 1e4])
        ids = range(min(vocab, rng.choice([3, 40, vocab])))  # few ids: many repeats
        bias = [
            (rng.randrange(-3, vocab + 3) if rng.random() < 0.1 else rng.choice(ids), rng.uniform(-100, 100))
            for _ in range(rng.randint(1, MAX_LOGIT_BIAS))
        ]
        params = SamplingParams(logit_bias=tuple(bias))
        assert torch.equal(adjust_logits(logits, params, [], [], []), slow_bias(logits, params.logit_bias))


def test_more_than_the_bound_is_refused_before_any_entry_is_read():
    SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)})
    with pytest.raises(RequestError, match=f"8192 entries; at most {MAX_LOGIT_BIAS}"):
        SamplingParams(logit_bias={i: -100.0 for i in range(8192)})
    # a bad entry among too many: the count is what is reported (it was checked first)
    with pytest.raises(RequestError, match=f"at most {MAX_LOGIT_BIAS}"):
        SamplingParams(logit_bias=[("x", 1.0)] + [(i, 1.0) for i in range(MAX_LOGIT_BIAS)])


class _CountOps(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(params: SamplingParams, logits: torch.Tensor) -> int:
    adjust_logits(logits, params, [], [], [])  # the request's first step builds its tensors
    with _CountOps() as counted:
        adjust_logits(logits, params, [], [], [])
    return counted.ops


def test_a_steps_work_does_not_grow_with_the_number_of_entries():
    """The tensors are built once per request; each step then adds them in one operation, whether
    the bias has 3 entries or 300 (a per-entry loop runs a few tensor operations per entry)."""
    logits = torch.randn(1000)
    few = SamplingParams(logit_bias=tuple((i, 1.5) for i in range(3)))
    many = SamplingParams(logit_bias=tuple((i, 1.5) for i in range(MAX_LOGIT_BIAS)))
    assert _ops_per_step(many, logits) == _ops_per_step(few, logits)
