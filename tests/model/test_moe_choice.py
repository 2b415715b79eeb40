"""The routed experts' path on a CPU: grouped only where its padding costs less than the loop's calls
(the two costs are measured per machine when a model is packed, `kernel_choice.expert_costs`; here
they are set, so that the arithmetic is what is tested)."""

import torch

from irminsul import LLM
from irminsul.model import layers
from irminsul.model.layers import MoE


def bundled_moe() -> MoE:
    llm = LLM(compile_decode=False)
    moe = next(m for m in llm.model.modules() if isinstance(m, MoE))
    moe.loop_call_s, moe.macs_per_s = 60e-6, 20e9  # 60 us a call, 20 G multiply-adds a second
    return moe


def test_grouped_for_small_balanced_batches_the_loop_for_skewed_or_sparse_ones():
    moe = bundled_moe()  # 8 experts of 256 x 128
    experts = len(moe.experts)
    assert moe._padding_pays(assignments=64, hit=experts, cap=8)  # balanced: no padding at all
    assert moe._padding_pays(assignments=64, hit=experts, cap=12)  # 32 padding rows: cheaper than 8 calls
    assert not moe._padding_pays(assignments=466, hit=experts, cap=114)  # 446 padding rows (measured 0.77x)
    assert not moe._padding_pays(assignments=6, hit=3, cap=2)  # fewer than half the experts hit


def test_at_deepseek_sizes_a_padding_row_costs_about_seven_calls(monkeypatch):
    moe = bundled_moe()
    # the padding's cost follows the experts' size: at 2048 x 1408 one row is ~0.4 ms of products
    big = torch.empty(1408, 2048, device="meta")
    monkeypatch.setattr(moe.experts[0].gate_proj, "weight", torch.nn.Parameter(big, requires_grad=False))
    assert moe._padding_pays(assignments=64 * 8, hit=8, cap=64)  # (8 experts here) no padding: grouped
    assert moe._padding_pays(assignments=64 * 8 - 1, hit=8, cap=64)  # one row: 0.43 ms < 8 calls' 0.48
    assert not moe._padding_pays(assignments=64 * 8 - 2, hit=8, cap=64)


def test_both_paths_give_the_same_output_and_forward_takes_the_cheaper():
    moe = bundled_moe()
    torch.manual_seed(0)
    for n in (4, 233):
        x = torch.randn(n, moe.gate.cfg.hidden_size)
        weights, ids = moe.gate(x)
        counts = torch.bincount(ids.flatten(), minlength=len(moe.experts))
        grouped = moe._grouped(x, weights, ids.reshape(-1), counts, int(counts.max()))
        looped = layers.expert_loop(x, weights, ids, lambda e, xs: moe.experts[e](xs))
        torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-5)
        shared = moe.shared_experts(x)
        torch.testing.assert_close(moe(x), looped + shared, rtol=1e-5, atol=1e-5)
