"""FLOPs counted from the config equal torch's FLOP counter; the hit/miss accounting is consistent."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from irminsul.model.loader import load_model
from irminsul.model.tiny import make_tiny_checkpoint
from irminsul.research.eval.accounting import Arch, Pass, forward_bytes, forward_flops
from irminsul.research.eval.cost import Scenario, correction, hit_vs_miss, run_cost
from irminsul.research.eval.shapes import DEEPSEEK_V2_LITE, QWEN3_32B


@pytest.fixture(scope="module")
def tiny_q_lora(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("acc") / "m", q_lora_rank=24)


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def test_mla_flops_equal_the_flop_counter_in_both_attention_forms(tiny_q_lora, monkeypatch):
    from irminsul.model.layers import MoE

    # The grouped expert path pads each expert's batch to the busiest one's; the count is of the
    # useful multiply-adds, which the per-expert path runs exactly.
    monkeypatch.setattr(MoE, "grouped", False)
    # likewise the CPU's expanded attention pads v to the q·k width for SDPA's flash kernel
    # (CPUAttention.EQUAL_WIDTHS): those zeros are not counted either
    from irminsul.model.attention.cpu import CPUAttention

    monkeypatch.setattr(CPUAttention, "EQUAL_WIDTHS", False)
    # and decode and prefill attention and the routed experts in torch's ops: the native kernels'
    # multiply-adds are outside the counter's sight
    monkeypatch.setattr(CPUAttention, "NATIVE_DECODE", False)
    monkeypatch.setattr(CPUAttention, "NATIVE_PREFILL", False)
    monkeypatch.setenv("IRMINSUL_NATIVE_MOE", "0")
    model = load_model(tiny_q_lora)
    arch = Arch.from_config(json.loads((tiny_q_lora / "config.json").read_text()))
    rows = model.new_rows(128)
    steps = [
        (torch.arange(50) + 5, torch.arange(50)),  # full prefill: the expanded form
        (torch.arange(10) + 9, torch.arange(60, 70)),  # sparse prefill after a gap: absorbed
        (torch.tensor([7]), torch.tensor([70])),
    ]  # decode
    forms = set()
    for ids, pos in steps:
        got = _counted(lambda: model.prefill(rows, ids, pos))
        want = forward_flops(arch, Pass.dense(pos.numpy(), logits=0))["total"]
        assert got == want
        forms.add(arch.attention_form(len(pos), int(pos.max()) + 1))
    assert forms == {"expanded", "absorbed"}


def test_gqa_flops_equal_the_flop_counter():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg)
    got = _counted(lambda: model(torch.arange(40)[None]))
    assert got == forward_flops(Arch.from_config(cfg.to_dict()), Pass.dense(range(40), logits=40))["total"]


def test_reference_shapes_have_their_published_sizes():
    lite, qwen = Arch.from_config(DEEPSEEK_V2_LITE), Arch.from_config(QWEN3_32B)
    assert lite.weight_params() / 1e9 == pytest.approx(15.7, abs=0.05)  # DeepSeek-V2-Lite: 15.7 B
    assert qwen.weight_params() / 1e9 == pytest.approx(32.8, abs=0.1)  # Qwen3-32B: 32.8 B
    assert lite.weight_params(tokens=1) < lite.weight_params() / 4  # one token touches 6 of 64 experts
    c_mla, c_gqa = correction(lite), correction(qwen)
    assert (c_mla["rotated_values_per_layer"], c_mla["row_values_per_layer"]) == (64, 576)
    assert (c_gqa["rotated_values_per_layer"], c_gqa["row_values_per_layer"]) == (1024, 2048)
    # 27 x 576 x 2 B = 31,104 B per token in bf16 (docs/design.md §2)
    assert c_mla["copied_bytes"] == 2 * 31104


def test_scenario_computes_header_tail_sink_and_last_token():
    sc = Scenario(prompt_tokens=100, header_tokens=10, shared_tokens=80)
    computed = set(sc.computed().tolist())
    assert computed == set(range(10)) | set(range(10, 32)) | set(range(90, 100))
    assert sc.reused == 100 - len(computed)
    assert Scenario(100, 10, 80, carve_out=False).reused == 80


def test_hit_costs_less_than_miss_and_more_reuse_saves_more():
    lite = Arch.from_config(DEEPSEEK_V2_LITE)
    small, big = (hit_vs_miss(lite, Scenario.of(4096, f)) for f in (0.5, 0.9))
    for r in (small, big):
        assert 0 < r["flops_saved_fraction"] < 1 and 0 < r["energy_saved_fraction"] < 1
        assert r["bytes_moved_per_hit"] < r["bytes_moved_per_miss"]
    assert big["energy_saved_fraction"] > small["energy_saved_fraction"]
    # The reused rows still cost their copy: more reuse, more bytes copied.
    assert big["hit_bytes_breakdown"]["copy"] > small["hit_bytes_breakdown"]["copy"]


def test_causal_pass_counts_half_the_attention_of_a_dense_one():
    qwen = Arch.from_config(QWEN3_32B)
    causal, dense = forward_flops(qwen, Pass.causal(range(1000))), forward_flops(qwen, Pass.dense(range(1000)))
    assert causal["attention"] / dense["attention"] == pytest.approx(0.5005, abs=1e-4)
    assert causal["linear"] == dense["linear"]
    b = forward_bytes(qwen, Pass.causal(range(1000)))
    assert b["total"] == pytest.approx(sum(v for k, v in b.items() if k != "total"))


def test_cost_result_json_has_the_issue_keys():
    archs = {"deepseek-v2-lite": Arch.from_config(DEEPSEEK_V2_LITE), "qwen3-32b-like": Arch.from_config(QWEN3_32B)}
    data = run_cost(archs, {k: 2048 for k in archs}).to_json()
    for name in archs:
        assert {"flops_saved_fraction", "bytes_moved_per_hit", "energy_saved_fraction"} <= set(data[name])
