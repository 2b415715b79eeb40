"""Products of several rows through oneDNN (layers.dnn_weight / dnn_linear) against F.linear."""

import torch
import torch.nn.functional as F

from irminsul.model.layers import DNN_BLOCKS, dnn_linear, dnn_weight


def test_every_row_count_equals_f_linear_and_onednn_sees_only_its_blocks(monkeypatch):
    """Bulk in multiples of 256, blocks of 32 and 8, padded tails, MKL for the rest: the same numbers as
    F.linear, and oneDNN is never called on another row count (it keeps a kernel and a weight copy
    for every row count it sees, so other counts would grow memory without end)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(400, 512, generator=g) / 512**0.5, torch.randn(400, generator=g)  # outputs of size ~1
    dnn = dnn_weight(w)
    assert dnn is not None and all(t is not None for t in dnn)
    seen = set()
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        seen.add(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    for rows in (2, 3, 4, 7, 8, 9, 13, 19, 20, 31, 32, 33, 63, 255, 256, 300, 517, 600):
        x = torch.randn(rows, 512, generator=g)
        got = dnn_linear(x, dnn, w, b)
        assert (got - F.linear(x, w, b)).abs().max().item() < 1e-4, rows
    assert seen and all(r in DNN_BLOCKS[1:] or r % DNN_BLOCKS[0] == 0 for r in seen), seen


def test_weights_that_do_not_pay_or_apply_get_no_copy():
    assert dnn_weight(torch.randn(16, 16)) is None  # too small for oneDNN's longer call to pay
    assert dnn_weight(torch.randn(300, 200, dtype=torch.bfloat16)) is None
    small_blocks = dnn_weight(torch.randn(256, 256))  # pays in blocks of 256 and 32 rows, not 8
    assert small_blocks is not None and small_blocks[2] is None
