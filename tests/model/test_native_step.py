"""The whole decode step in one native call (model/native/step.c, model/native_step.py) against the
model's eager forward pass: the final hidden states and every layer's new pool row, on each build this
CPU executes (tests/model/native_variants.py), for the routing and attention variants the families
have (V2's softmax greedy routing, V3's sigmoid with groups and a correction bias, a query LoRA, YaRN,
attention biases, both RoPE pair layouts, the bundled model's widths), one sequence and batches of
sequences of different lengths over scattered slots (more than the 8 rows its products take at a time too); and the engine's greedy tokens with it equal
those without it."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from irminsul import LLM, bundled_model
from irminsul.model import native, native_step
from irminsul.model.attention.base import SeqAttention
from irminsul.model.loader import load_model
from irminsul.model.mla import ForwardBatch
from irminsul.model.settings import Settings
from irminsul.model.tiny import make_tiny_checkpoint
from tests.model.native_variants import variant  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="the native step needs a C compiler")

FAMILIES = {
    "v2": dict(variant="v2"),
    "v3-yarn": dict(variant="v3", yarn=True),
    "glm-qlora": dict(variant="glm"),
    "v2-bias-half": dict(variant="v2", attention_bias=True, q_lora_rank=24),
    "v2-groups": dict(variant="v2", topk_method="group_limited_greedy", n_group=2, topk_group=1),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, kw in FAMILIES.items():
        path = make_tiny_checkpoint(tmp_path_factory.mktemp(name), seed=3, **kw)
        out[name] = load_model(path)
    out["bundled"] = load_model(bundled_model("mla"))
    return out


def _eager(model, tokens, positions, table, pool):
    specs = [SeqAttention(np.array([p]), table[b, : p + 1]) for b, p in enumerate(positions)]
    batch = ForwardBatch(
        torch.as_tensor(tokens),
        torch.as_tensor(positions),
        pool,
        torch.as_tensor([table[b, p] for b, p in enumerate(positions)]),
        model.attention.plan(specs, list(range(len(tokens) + 1)), model.device),
    )
    return model(batch)


@pytest.mark.parametrize("family", [*FAMILIES, "bundled"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=20), seed=st.integers(0, 2**16))
def test_the_step_equals_the_eager_forward_pass(variant, models, family, lengths, seed):
    model = models[family]
    cfg = model.config
    rng = np.random.default_rng(seed)
    slots = 1 + rng.permutation(sum(lengths) + 8)  # every sequence's rows scattered over the pool
    table = np.zeros((len(lengths), max(lengths)), np.int64)
    at = 0
    for b, n in enumerate(lengths):
        table[b, :n] = slots[at : at + n]
        at += n
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(cfg.num_hidden_layers, len(slots) + 2, cfg.row_width, generator=g) * 0.3
    mine = pool.clone()
    tokens = rng.integers(0, cfg.vocab_size, len(lengths))
    positions = np.array(lengths) - 1
    step = native_step.NativeDecode(model)
    want = _eager(model, tokens, positions, table, pool)
    got = step(tokens, positions, table, mine)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2e-5 * scale + 1e-5
    assert torch.allclose(mine, pool, atol=1e-5, rtol=1e-5)  # the new rows, and nothing else changed
    logits = step.logits(tokens, positions, table, pool.clone())  # (the LM head in the same call, where it runs)
    want_logits = model.logits(want)
    assert (logits - want_logits).abs().max().item() <= 2e-5 * want_logits.abs().max().item() + 1e-5


def test_the_engines_greedy_tokens_are_those_without_it(models, monkeypatch):
    path = bundled_model("mla")
    prompts = [[300 + (i * 7 + j * 13) % 5000 for i in range(40 + 9 * j)] for j in range(3)]
    runs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("IRMINSUL_NATIVE_STEP", mode)  # (read when the model is loaded)
        llm = LLM(path, compile_decode=False)
        assert (llm.engine.runner.native is not None) == (mode == "1")
        runs[mode] = [o.token_ids for o in llm.generate(prompts, max_tokens=24, ignore_eos=True)]
        runs[mode + "-one"] = llm.generate(prompts[0], max_tokens=24, ignore_eos=True).token_ids
    assert runs["1"] == runs["0"]
    assert runs["1-one"] == runs["0-one"]


def test_the_engine_takes_it_only_for_the_step_classes_that_pay(models, monkeypatch):
    monkeypatch.setenv("IRMINSUL_NATIVE_STEP", "1")
    llm = LLM(bundled_model("mla"), compile_decode=False)
    runner = llm.engine.runner
    calls = []
    real = native_step.NativeDecode._run

    def counted(self, tokens, *args):
        calls.append(len(tokens))
        return real(self, tokens, *args)

    monkeypatch.setattr(native_step.NativeDecode, "_run", counted)
    prompts = [[5 + i for i in range(30)], [9 + i for i in range(20)]]
    llm.generate(prompts, max_tokens=4, ignore_eos=True)
    assert 2 in calls
    calls.clear()
    runner.native.max_batch = 1
    runner.native.pays = {"one": True, "batch": False}
    llm.generate(prompts, max_tokens=4, ignore_eos=True)
    assert calls == []  # (the batch ran eagerly)
    llm.generate(prompts[0], max_tokens=4, ignore_eos=True)
    assert calls == [1, 1, 1]  # (the prefill step made the first token)
    calls.clear()
    runner.native.pays = {"one": False, "batch": False}
    llm.generate(prompts[0], max_tokens=4, ignore_eos=True)
    assert calls == []


def test_the_measurement_compares_it_with_the_eager_step(models):
    step = native_step.NativeDecode(models["bundled"])
    verdict = step.measure(keys=32, sizes=(1, 2, 4))
    times = verdict["times"]
    assert all(t["native"] > 0 and t["eager"] > 0 for t in times.values())
    pays = {n: times[str(n)]["native"] <= native_step.PAYS * times[str(n)]["eager"] for n in (1, 2, 4)}
    assert verdict["one"] == pays[1]
    assert verdict["batch_max"] == (0 if not pays[2] else 2 if not pays[4] else 4)


def test_what_it_does_not_cover_is_said(tmp_path):
    longcat = load_model(make_tiny_checkpoint(tmp_path / "lc", variant="longcat"))
    assert "LongCat" in native_step.supported(longcat)
    bf16 = load_model(bundled_model("mla"), dtype="bfloat16")
    assert "float32" in native_step.supported(bf16)
    off = load_model(bundled_model("mla"), settings=dataclasses.replace(Settings.from_env(), native_step="0"))
    assert native_step.unavailable(off) is not None and native_step.resolve(off) is None


def test_one_sequences_logits_come_from_the_same_call_where_the_lm_head_takes_one_row_through_gemv(models, monkeypatch):
    model = models["bundled"]
    # (as the kernel choice measures it on a CPU where gemv.c wins one row; the tests' fixed rule says 0)
    monkeypatch.setattr(model.lm_head, "gemv_rows", 1)
    step = native_step.NativeDecode(model)
    seen = []
    real = native_step.NativeDecode._run

    def spy(self, tokens, positions, slots, pool, with_logits):
        seen.append(with_logits)
        return real(self, tokens, positions, slots, pool, with_logits)

    monkeypatch.setattr(native_step.NativeDecode, "_run", spy)
    cfg = model.config
    pool = torch.randn(cfg.num_hidden_layers, 40, cfg.row_width, generator=torch.Generator().manual_seed(2)) * 0.3
    table = np.arange(1, 31)[None]
    want = model.logits(_eager(model, np.array([17]), np.array([29]), table, pool.clone()))
    got = step.logits(np.array([17]), np.array([29]), table, pool)
    assert seen == [True]
    assert (got - want).abs().max().item() <= 2e-5 * want.abs().max().item() + 1e-5
