"""DeepSeek-V4's reuse contract, checked directly on the model (docs/deepseek-v4.md): content computed
behind one prefix, its per-token rows reused behind another, against full prefill of the new prompt.
Used by tests/model/test_deepseek_v4.py and benchmarks/v4_reuse.py."""

from __future__ import annotations

import torch


def shifted_reuse_error(
    model, before_a: int, before_b: int, content: int = 40, naive: bool = False, seed: int = 0, vocab: int = 256
) -> float:
    """`content` random tokens computed behind a prefix of `before_a` tokens, then reused (their rows copied
    as they are) behind one of `before_b` (a shift of before_b - before_a), in front of 6 new tokens ->
    max |Δ log-prob| of the computed positions against full prefill of the new prompt. naive: the reused
    keys are rotated where they were computed (stale), the paper's baseline."""
    a, b, n = before_a, before_b, content
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(0, vocab, (n,), generator=g)
    first = torch.cat([torch.randint(0, vocab, (a,), generator=g), body])
    second = torch.cat([torch.randint(0, vocab, (b,), generator=g), body, torch.randint(0, vocab, (6,), generator=g)])
    donor = model.new_rows(len(first))
    model.prefill(first, torch.arange(len(first)), donor)
    rows = model.new_rows(len(second))
    for mine, theirs in zip(rows, donor):
        mine[b : b + n] = theirs[a : a + n]
    compute = torch.cat([torch.arange(b), torch.arange(b + n, len(second))])
    key_pos = None
    if naive:
        key_pos = torch.arange(len(second))
        key_pos[b : b + n] -= b - a
    got = model.prefill(second, compute, rows, key_pos).log_softmax(-1)
    return (got - model.forward(second)[compute].log_softmax(-1)).abs().max().item()
