"""The linear products' layouts and kernels chosen per machine (model/kernel_choice.py): every choice
computes F.linear's product, the times are cached and reused, an unwritable cache still loads, and a
packed model holds its weights about once."""

import json
import time

import pytest
import torch
import torch.nn.functional as F

from irminsul.model import kernel_choice
from irminsul.model.kernel_choice import Choice, KernelChoices, Product
from irminsul.model.layers import MoE, dnn_linear, dnn_weight, pack_linears, packed
from irminsul.model.loader import load_model

BF16_DNN = kernel_choice.dnn_applies(torch.bfloat16)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # relative to the product's largest value


def _close(got, want, dtype):
    scale = want.float().abs().max().item()
    return (got.float() - want.float()).abs().max().item() <= TOL[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_f, in_f", [(400, 512), (96, 80), (1030, 136)])
def test_every_layout_and_block_copy_computes_f_linear(dtype, out_f, in_f):
    """Out-major, input-major, and oneDNN with each single block copy (as the choices keep them) and with
    all three (the fixed rule), at row counts below, at and between the blocks: F.linear's product."""
    g = torch.Generator().manual_seed(out_f + in_f)
    w = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype)
    w_in = w.t().contiguous()  # [in, out], as pack_linears stores input-major
    copies = [(256,), (32,), (8,), (256, 32, 8)] if dtype == torch.float32 or BF16_DNN else []
    dnn = {blocks: dnn_weight(w, blocks=blocks) for blocks in copies}
    for rows in (1, 2, 3, 5, 8, 13, 17, 20, 32, 45, 100, 130, 256, 300, 515):
        x = torch.randn(rows, in_f, generator=g).to(dtype)
        want = F.linear(x.double(), w.double(), bias.double())
        assert _close(F.linear(x, w, bias), want, dtype), rows
        assert _close(packed(x, w_in, bias), want, dtype), rows
        assert _close(packed(x, w.t(), bias), want, dtype), rows  # out-major through `packed`
        for blocks, copy in dnn.items():
            assert copy is not None and sum(c is not None for c in copy) == len(blocks)
            assert _close(dnn_linear(x, copy, w, bias), want, dtype), (rows, blocks)


@pytest.mark.parametrize("layout", ["in", "out"])
def test_pack_linears_in_either_layout_is_one_storage_of_views(layout):
    g = torch.Generator().manual_seed(1)
    a, b = torch.nn.Linear(64, 24, bias=False), torch.nn.Linear(64, 40, bias=False)
    with torch.no_grad():
        a.weight.copy_(torch.randn(24, 64, generator=g))
        b.weight.copy_(torch.randn(40, 64, generator=g))
    want_a, want_b = a.weight.clone(), b.weight.clone()
    w, bias = pack_linears(a, b, layout=layout)
    assert bias is None and w.shape == (64, 64)
    assert w.is_contiguous() == (layout == "in") and w.t().is_contiguous() == (layout == "out")
    assert torch.equal(a.weight, want_a) and torch.equal(b.weight, want_b)
    assert (
        a.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() == b.weight.untyped_storage().data_ptr()
    )
    x = torch.randn(5, 64, generator=g)
    assert torch.allclose(packed(x, w, None), torch.cat([x @ want_a.t(), x @ want_b.t()], -1), atol=1e-5)


@pytest.mark.parametrize("layouts", [("in", "in"), ("out", "out"), ("out", "in")])
def test_moe_stacked_in_either_layout_gives_the_same_experts(layouts):
    from irminsul.model.config import ModelConfig
    from irminsul.model.tiny import tiny_config

    cfg = ModelConfig.from_dict(tiny_config("v2"))
    torch.manual_seed(0)
    moe = MoE(cfg).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = moe(x)  # (not stacked yet: each expert's own weights)
        moe.layouts = layouts
        gate_up, down = moe.stacked()
        assert (gate_up.stride(2) == 1) == (layouts[0] == "in") and (down.stride(2) == 1) == (layouts[1] == "in")
        assert moe.experts[0].gate_proj.weight.data_ptr() == gate_up.data_ptr()
        for n in (1, 3, 37):  # one token (its k experts), the loop, the grouped product
            assert (moe(x[:n]) - want[:n]).abs().max().item() < 1e-5, n
            dense = moe.dense(x[:n], *moe.gate(x[:n]))  # (the compiled step's form: every expert, weighted)
            dense = dense if moe.shared_experts is None else dense + moe.shared_experts(x[:n])
            assert (dense - want[:n]).abs().max().item() < 1e-5, n


@pytest.mark.parametrize(
    "choices",
    [
        KernelChoices.every("out", (32,)),
        KernelChoices.every("in", (8,)),
        KernelChoices.every("out"),
        KernelChoices.every("in", (256,)),
        KernelChoices.every("in", widen=32),
        KernelChoices.every("out", widen=32),
        "fixed",
        "measured",
    ],
    ids=["out+dnn32", "in+dnn8", "out", "in+dnn256", "in+widen32", "out+widen32", "fixed", "measured"],
)
def test_a_model_packed_by_any_choices_computes_the_unpacked_models_logits(tiny_dir, choices, tmp_path, monkeypatch):
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    plain = load_model(tiny_dir, pack=False)
    model = load_model(tiny_dir, pack=False).pack(kernels=choices)
    a, b = model.state_dict(), plain.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if isinstance(choices, KernelChoices):  # the layout asked for, where the choices may
        assert model.lm_head.weight.is_contiguous() == (choices.forced.layout == "out")
        attn = model.model.layers[0].self_attn
        assert attn.in_proj[0].is_contiguous() == (choices.forced.layout == "in")
        assert attn.o_proj.weight.is_contiguous()  # (a linear of its own keeps nn.Linear's layout)
    ids = torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(8)).tolist()
    got = []
    for m in (model, plain):
        seq = m.new_rows(128)
        many = m.logits(m.prefill(seq, ids, list(range(70))))  # (70 rows: blocks, padding, a rest)
        got.append((many, m.logits(m.prefill(seq, [5], [70]))))  # and one row, a decode step
    assert (got[0][0] - got[1][0]).abs().max().item() < 1e-4
    assert (got[0][1] - got[1][1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("layout", ["in", "out"])
def test_a_tied_table_is_looked_up_in_rows_whatever_the_heads_layout(tmp_path, monkeypatch, layout):
    """A tied embedding whose LM head is stored input-major is read from a row-major copy (a lookup
    of the transposed table reads one float per cache line); the rows and logits are the unpacked
    model's; a table replaced after packing is read as it now is; out-major keeps no copy."""
    from irminsul.model.tiny import make_tiny_checkpoint

    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    path = make_tiny_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    plain = load_model(path, pack=False)
    model = load_model(path, pack=False).pack(kernels=KernelChoices.every(layout))
    table = model.model.embed_tokens.weight
    assert table.data_ptr() == model.lm_head.weight.data_ptr()  # still tied
    ids = torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(3))
    if layout == "in":
        assert not table.is_contiguous() and model.embed_rows is not None and model.embed_rows.is_contiguous()
        assert model.embed_rows.data_ptr() != table.data_ptr()
    else:
        assert model.embed_rows is None
    assert torch.equal(model.embed(ids), plain.model.embed_tokens(ids))
    a = model.logits(model.prefill(model.new_rows(128), ids.tolist(), list(range(70))))
    b = plain.logits(plain.prefill(plain.new_rows(128), ids.tolist(), list(range(70))))
    assert (a - b).abs().max().item() < 1e-4
    with torch.no_grad():
        model.model.embed_tokens.weight = torch.nn.Parameter(2 * table.detach().clone(), requires_grad=False)
    assert torch.equal(model.embed(ids), 2 * plain.model.embed_tokens(ids)) and model.embed_rows is None


def _fake_times(out, inp, dtype, streamed, with_dnn, with_gemv=False):
    """Times where input-major wins everywhere and oneDNN wins at 32 rows by 2x (so the choices are
    known); no one-row kernel timed."""
    t = {}
    for rows in kernel_choice.ROWS:
        base = 1e-6 * rows * out * inp / 1e4
        t[str(rows)] = {"out": 1.5 * base, "in": base}
        if with_dnn and rows in kernel_choice.BLOCKS:
            t[str(rows)]["dnn"] = base / 2 if rows == 32 else 2 * base
    return t


def test_the_times_are_cached_in_a_file_and_reused(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "kernels.json"
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(path))
    monkeypatch.setattr(kernel_choice, "_memory", {})
    calls = []
    monkeypatch.setattr(kernel_choice, "measure", lambda *a: calls.append(a) or _fake_times(*a))
    products = [Product(300, 200, torch.float32, 2, 2.0), Product(64, 200, torch.float32, 1, 1.0, "out")]
    first = kernel_choice.choose(products, model_bytes=10**9, kernels="measured", progress=False)
    assert len(calls) == 2 and path.exists()
    data = json.loads(path.read_text())
    assert data["cpu"] == kernel_choice.cpu_key() and len(data["entries"]) == 2
    assert first.choices[(300, 200, torch.float32, None)] == Choice("in", (32,))
    assert first.choices[(64, 200, torch.float32, "out")] == Choice("out", (32,))  # its layout kept
    # a new process (nothing in memory) reads the file and measures nothing
    monkeypatch.setattr(kernel_choice, "_memory", {})
    monkeypatch.setattr(kernel_choice, "measure", lambda *a: pytest.fail("measured again"))
    again = kernel_choice.choose(products, model_bytes=10**9, kernels="measured", progress=False)
    assert again.choices == first.choices
    # the fixed rule measures nothing either
    fixed = kernel_choice.choose(products, model_bytes=10**9, kernels="fixed")
    assert fixed.choices[(300, 200, torch.float32, None)] == Choice("in", (256, 32))  # 8 x 60k < DNN_MIN_MACS


def test_the_copy_budget_bounds_what_is_held(tmp_path, monkeypatch):
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setattr(kernel_choice, "_memory", {})
    monkeypatch.setattr(kernel_choice, "measure", _fake_times)
    products = [Product(300, 200, torch.float32, 4, 4.0), Product(500, 200, torch.float32, 1, 1.0)]
    weights = 4 * 300 * 200 * 4 + 500 * 200 * 4
    none = kernel_choice.choose(products, weights, kernels="measured", budget=0.0, progress=False)
    assert all(c.blocks == () for c in none.choices.values())
    some = kernel_choice.choose(products, weights, kernels="measured", budget=0.3, progress=False)
    held = sum(p.weight_bytes() * p.count for p in products if some.choices[p.key].blocks)
    assert 0 < held <= 0.3 * weights


def test_an_unwritable_cache_still_loads(tiny_dir, tmp_path, monkeypatch):
    """A cache file whose directory cannot be made (its parent is a file: refused even to root) or
    holds garbage: the model loads, measuring, and computes the same logits."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(blocker / "kernels.json"))
    monkeypatch.setattr(kernel_choice, "_memory", {})
    model = load_model(tiny_dir)
    assert model.kernel_choices.kernels == "measured" and model.kernel_choices.choices
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(garbage))
    monkeypatch.setattr(kernel_choice, "_memory", {})
    again = load_model(tiny_dir)
    assert json.loads(garbage.read_text())["entries"]  # rewritten
    ids = list(range(3, 40))
    a = model.logits(model.prefill(model.new_rows(64), ids, list(range(len(ids)))))
    b = again.logits(again.prefill(again.new_rows(64), ids, list(range(len(ids)))))
    assert (a - b).abs().max().item() < 1e-4


def _held_bytes(model) -> int:
    """Bytes of every distinct storage the model holds: parameters and oneDNN copies."""
    seen, total = set(), 0
    tensors = [p for p in model.parameters()] + ([model.embed_rows] if model.embed_rows is not None else [])
    for m in model.modules():
        for name in ("dnn", "gate_up_dnn", "in_proj_dnn"):
            for t in getattr(m, name, None) or ():
                if t is not None:
                    tensors.append(t)
    for t in tensors:
        if t.is_mkldnn:
            total += t.numel() * t.element_size()
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def test_weights_are_held_about_once(tiny_dir, tmp_path, monkeypatch):
    """Measured: the parameters plus copies within the budget; the fixed rule held copies for three
    blocks of every weight large enough."""
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    plain = load_model(tiny_dir, pack=False)
    params = _held_bytes(plain)
    measured = load_model(tiny_dir)
    assert _held_bytes(measured) <= (1 + kernel_choice.COPY_BUDGET) * params * 1.01
    assert all(len(c.blocks) <= 1 for c in measured.kernel_choices.choices.values())
    fixed = load_model(tiny_dir, pack=False).pack(kernels="fixed")
    assert fixed.lm_head.dnn is not None and fixed.lm_head.dnn[0] is not None  # (blocks of 256: the tiny sizes)
    assert not fixed.lm_head.weight.is_contiguous()  # input-major, as the rule had it
    assert _held_bytes(fixed) > 1.3 * params  # (1.4x at these sizes; 3.5x at 2,048 wide)


def test_a_hopeless_candidate_is_called_once_and_never_chosen():
    """A candidate far slower than one timed before it gets its second call's time, not samples (a
    CPU's pathological path must not make the first load measure for minutes)."""
    calls = {"fast": 0, "slow": 0}

    def fast():
        calls["fast"] += 1

    def slow():
        calls["slow"] += 1
        time.sleep(0.05)

    times = kernel_choice._time({"fast": fast, "slow": slow})
    assert calls["slow"] == 2 and calls["fast"] > 2
    assert times["slow"] >= 0.05 > times["fast"]
    # in the other order both are sampled: the first candidate has nothing to be compared with
    calls.update(fast=0, slow=0)
    kernel_choice._time({"slow": slow, "fast": fast})
    assert calls["slow"] > 2


def test_bf16_packing_keeps_w_uk_and_w_uv_in_their_own_memory_and_equal_to_kv_bs_halves(
    tiny_dir, tmp_path, monkeypatch
):
    """A bf16 packed model holds W_UK and W_UV as copies of kv_b_proj's two halves (a bf16 bmm would
    copy the strided slices on every call), W_UV contiguous and W_UK stored [H, r, nope] (each output's
    weights contiguous, as the native per-head products read them); its logits are the unpacked
    model's; a weight replaced after packing is read through its own slices again."""
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    plain = load_model(tiny_dir, dtype="bfloat16", pack=False)
    model = load_model(tiny_dir, dtype="bfloat16", pack=False).pack(kernels=KernelChoices.every("out"))
    attn = model.model.layers[0].self_attn
    cfg = model.config
    uk, uv = attn.absorbed
    assert uk.transpose(1, 2).is_contiguous() and uv.is_contiguous()
    halves = attn.kv_b_proj.weight.view(cfg.num_attention_heads, -1, cfg.kv_lora_rank)
    assert torch.equal(uk, halves[:, : cfg.qk_nope_head_dim]) and torch.equal(uv, halves[:, cfg.qk_nope_head_dim :])
    assert model.attention.absorbed_weights(attn)[0] is uk
    ids = list(range(3, 40))
    rows = {m: m.new_rows(64) for m in (model, plain)}
    for m in (model, plain):
        m.prefill(rows[m], ids, list(range(len(ids))))
    a, b = (m.logits(m.prefill(rows[m], [7], [len(ids)])) for m in (model, plain))  # a decode step: absorbed
    assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item()
    attn.kv_b_proj.weight = torch.nn.Parameter(attn.kv_b_proj.weight.detach().clone(), requires_grad=False)
    assert model.attention.absorbed_weights(attn)[0] is not uk
    fp32 = load_model(tiny_dir, pack=False).pack(kernels=KernelChoices.every("out"))
    assert all(layer.self_attn.absorbed is None for layer in fp32.model.layers)  # (fp32 reads the slices in place)


def test_the_native_experts_run_at_the_token_counts_where_they_won(tmp_path, monkeypatch):
    """`native_experts_counts` times the native kernel against the layer's torch path at every count of
    EXPERT_TOKENS (what wins need not be monotone: here the kernel loses at one token and wins from
    four to 32), stops once both paths' calls take EXPERT_CALL_LIMIT_S (one slow path alone goes on: the
    other may be the one that wins there), is cached per CPU like the linear times;
    the fixed rule takes every count up to MoE.NATIVE_TOKENS; a layer with no native kernel gets none."""
    from irminsul.model.config import ModelConfig
    from irminsul.model.tiny import tiny_config

    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setattr(kernel_choice, "_memory", {})
    moe = MoE(
        ModelConfig.from_dict(
            tiny_config("v2", hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2)
        )
    )
    seen = []
    monkeypatch.setattr(moe, "native_kernel", lambda dtype: lambda x, *rest: seen.append(x.shape[0]))
    native = {1: 2.0, 2: 1.5, 4: 0.5, 8: 0.6, 16: 0.9, 32: 1.9, 64: 600.0, 128: 800.0}  # ms
    torch_ms = {n: 1 + n / 32 for n in native} | {128: 510.0}

    def timed(cands):  # (deterministic)
        cands["native"]()
        n = seen[-1]
        return {"native": native[n] / 1e3, "torch": torch_ms[n] / 1e3}

    monkeypatch.setattr(kernel_choice, "_time", timed)
    assert kernel_choice.native_experts_counts(moe, torch.float32) == (4, 8, 16, 32)
    assert seen == [1, 2, 4, 8, 16, 32, 64, 128]  # every count, until both passed the limit (128; 64: one)
    monkeypatch.setattr(kernel_choice, "_memory", {})  # a new process reads the file
    monkeypatch.setattr(kernel_choice, "_time", lambda cands: pytest.fail("measured again"))
    assert kernel_choice.native_experts_counts(moe, torch.float32) == (4, 8, 16, 32)
    assert kernel_choice.native_experts_counts(moe, torch.float32, "fixed") == (1, 2, 4, 8, 16, 32, 64)
    monkeypatch.setattr(moe, "native_kernel", lambda dtype: None)
    assert kernel_choice.native_experts_counts(moe, torch.float32) == ()


def test_a_packed_moe_routes_by_its_measured_counts(tiny_dir, tmp_path, monkeypatch):
    """A packed model's MoE layers carry the measured counts, and `routed` sends a batch to the native
    kernel exactly when the count it is judged by (the next EXPERT_TOKENS one up) won."""
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setattr(kernel_choice, "_memory", {})
    monkeypatch.setattr(kernel_choice, "native_experts_counts", lambda moe, dtype, kernels=None: (4, 8))
    model = load_model(tiny_dir)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes and all(m.native_counts == (4, 8) and m.native_tokens == 8 for m in moes)
    moe, ran = moes[0], []
    monkeypatch.setattr(moe, "native_kernel", lambda dtype: lambda x, w, ids, *stacks: ran.append(len(x)) or x)
    for n in (1, 2, 3, 4, 5, 8, 9):
        x = torch.randn(n, model.config.hidden_size)
        moe.routed(x, *moe.gate(x))
    assert ran == [3, 4, 5, 8]  # 1 and 2: the kernel lost there; 9: past what won


def test_the_expert_loops_costs_are_measured_once_per_cpu(tmp_path, monkeypatch):
    """`expert_costs`: a positive time per loop call and rate of the grouped product, timed on the
    layer's weights and read back from the cache by a new process."""
    from irminsul.model.config import ModelConfig
    from irminsul.model.tiny import tiny_config

    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setattr(kernel_choice, "_memory", {})
    moe = MoE(
        ModelConfig.from_dict(
            tiny_config("v2", hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2)
        )
    )
    call_s, macs = kernel_choice.expert_costs(moe, torch.float32)
    assert 0 < call_s < 1 and macs > 1e6
    monkeypatch.setattr(kernel_choice, "_memory", {})
    monkeypatch.setattr(kernel_choice, "_time", lambda cands: pytest.fail("measured again"))
    assert kernel_choice.expert_costs(moe, torch.float32) == (call_s, macs)
