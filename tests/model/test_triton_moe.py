"""The Triton MoE kernels (triton_moe.py) against the torch experts, under Triton's interpreter."""

import pytest
import torch

from irminsul.model.config import ModelConfig
from irminsul.model.layers import MoE, expert_loop
from irminsul.model.tiny import tiny_config

pytest.importorskip("triton")
pytest.importorskip("numpy")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (benchmarks/gpu_check.sh runs these on a GPU)


def _moe(seed: int, **overrides) -> MoE:
    cfg = ModelConfig.from_dict(tiny_config("v2", **overrides))
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2)
    return moe.eval().to(DEVICE)


@pytest.mark.parametrize(
    "n, tiles", [(1, None), (5, None), (37, None), (37, (32, 64, 16, 4, 3)), (5, (64, 16, 64, 8, 2))]
)
def test_fused_experts_equal_the_torch_experts(n, tiles):
    """Every token's k experts, weighted, for batches where experts get 0, 1 or many rows (padding
    inside a block, blocks past the last used): equal to the loop over experts within 1e-5; with the
    default tiles and with others (benchmarks/gpu_tiles.py picks among such on a GPU)."""
    from irminsul.model.triton_moe import TILES, MoeTiles, fused_experts

    moe = _moe(n)
    x = torch.randn(n, moe.gate.cfg.hidden_size, generator=torch.Generator().manual_seed(n)).to(DEVICE)
    with torch.no_grad():
        weights, ids = moe.gate(x)
        want = expert_loop(x, weights, ids, lambda e, xs: moe.experts[e](xs))
        got = fused_experts(x, weights, ids, *moe.stacked(), MoeTiles(*tiles) if tiles else TILES)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5


def test_align_puts_each_block_under_one_expert():
    from irminsul.model.triton_moe import align

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]], device=DEVICE)
    rows, block_expert = align(ids, experts=5, block_m=4)
    a = ids.numel()
    assert rows.numel() == block_expert.numel() * 4
    for b, e in enumerate(block_expert.tolist()):
        block = rows[4 * b : 4 * b + 4]
        real = block[block < a]
        if e == 5:  # unused blocks hold padding only
            assert real.numel() == 0
        else:
            assert (ids.reshape(-1)[real] == e).all()
    assert sorted(rows[rows < a].tolist()) == list(range(a))  # every assignment exactly once


def test_the_triton_backend_runs_the_moe_through_the_kernel(tiny_dir, monkeypatch):
    """With attention_backend="triton" the MoE layers take the fused kernel (no host read of the
    expert counts), and a prefill's log-probs equal the torch backend's within 1e-4."""
    from irminsul.model import triton_moe
    from irminsul.model.loader import load_model

    calls = []
    real = triton_moe.fused_experts
    monkeypatch.setattr(triton_moe, "fused_experts", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2))
    ref = load_model(tiny_dir, device=DEVICE)
    want = ref.logits(ref.prefill(ref.new_rows(), ids, torch.arange(40))).log_softmax(-1)
    model = load_model(tiny_dir, device=DEVICE)
    model.set_attention_backend("triton")
    got = model.logits(model.prefill(model.new_rows(), ids, torch.arange(40))).log_softmax(-1)
    assert calls and (got - want).abs().max().item() < 1e-4
