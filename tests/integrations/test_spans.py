"""The engine-agnostic half of the vLLM integration (no vLLM needed): plans of a moved document,
the chunks to save, and the δ-rotation in vLLM's pair layout."""

import numpy as np
import torch

from irminsul.integrations.vllm.spans import SpanIndex, rotate_interleaved


def test_a_moved_document_is_loaded_and_its_header_computed():
    rng = np.random.default_rng(0)
    doc, ha, hb, q = (rng.integers(0, 256, n).tolist() for n in (600, 40, 75, 8))
    index = SpanIndex("m", bytes_per_token=1, budget_bytes=10**6)
    first = index.plan(ha + doc + q)
    assert first.loads == []
    saved = index.to_save(first, len(first.plan.tokens))
    assert saved and index.to_save(first, len(first.plan.tokens)) == []  # each chunk handed out once
    moved = index.plan(hb + doc + q)
    loaded = sum(len(x) for x in moved.loads)
    assert loaded >= 500 and moved.loads[0].start >= 75 - 32  # most of the document; not the header
    assert all(x.delta == 75 - 40 for x in moved.loads)
    assert moved.loads[-1].end < len(moved.plan.tokens)  # the last token is computed
    assert moved.next_load_start(0) == moved.loads[0].start
    assert moved.load_at(moved.loads[0].start)[0] == moved.loads[0]
    index.release(moved)


def test_rotation_by_delta_is_encoding_at_the_new_position():
    torch.manual_seed(0)
    dim = 64
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    k = torch.randn(5, dim, dtype=torch.float64)

    def encode(x, p):  # GPT-J pairs at position p
        return rotate_interleaved(x, p, inv_freq)

    assert torch.allclose(rotate_interleaved(encode(k, 100).float(), 37, inv_freq), encode(k, 137).float(), atol=1e-5)
