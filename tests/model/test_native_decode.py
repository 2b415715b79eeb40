"""Decode attention through the native kernel (model/native/mla_decode.c, `CPUAttention.NATIVE_DECODE`):
one query per sequence, read straight from the pool, against tests/model/test_attention_flash.py's
float64 dense reference and against the torch ops it replaces, on each build this CPU executes
(tests/model/native_variants.py): batches of sequences of different
lengths (padding slots), holes, keys at moved RoPE positions, both pair layouts, float32 and bfloat16
pools; and the engine's greedy decode is the same with and without it."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from irminsul import LLM
from irminsul.model import native
from irminsul.model.attention.cpu import CPUAttention
from irminsul.model.settings import Settings
from irminsul.model.tiny import make_tiny_checkpoint
from tests.model.native_variants import variant  # noqa: F401 (a fixture)
from tests.model.test_attention_flash import _case, _reference, _run, _setup

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="the native kernel needs a C compiler")


def _decode_case(cfg, g, lengths, dtype=torch.float32, **kw):
    """Sequences decoding their last position: (start, 1) spans, start + 1 = each length."""
    return _case(cfg, g, [(n - 1, 1) for n in lengths], dtype=dtype, **kw)


# the test models' widths (r 32, rope 8, 3 heads: the kernel's plain loops), the bundled model's (r 128,
# rope 16, 8 heads: the register tiles, 4 heads x 4 keys and 4 heads x 64 outputs), a realistic rope
# (64) and widths that leave each tile a remainder (6 heads: 4 in tiles, 2 in plain loops; r 80: a
# 64-wide tile and a 16-wide one)
WIDTHS = {
    "tiny": {},
    "bundled": dict(kv_lora_rank=128, qk_rope_head_dim=16, num_attention_heads=8, num_key_value_heads=8),
    "rope64": dict(kv_lora_rank=64, qk_rope_head_dim=64),
    "tails": dict(kv_lora_rank=80, qk_rope_head_dim=32, num_attention_heads=6, num_key_value_heads=6),
}


@pytest.mark.parametrize("widths", list(WIDTHS))
@pytest.mark.parametrize("layout", ["interleaved", "half"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=6),
    holes=st.booleans(),
    moved=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_decode_groups_equal_the_dense_reference(variant, widths, layout, lengths, holes, moved, seed):
    cfg, backend, attn, g = _setup(seed, **WIDTHS[widths])
    backend.rotary.out_layout = layout
    q_nope, q_pe, pool, seqs = _decode_case(cfg, g, lengths, holes=holes, moved=moved)
    want = _reference(cfg, backend, attn, q_nope, q_pe, pool, seqs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CPUAttention, "NATIVE_DECODE", True)
        calls = []
        from irminsul.model import native_ops as ta

        real = ta.call_mla_decode
        mp.setattr(ta, "call_mla_decode", lambda *a: calls.append(1) or real(*a))
        got, _, _ = _run(backend, attn, q_nope, q_pe, pool, seqs, expanded=False)
    assert calls  # (the kernel ran)
    assert (got.double() - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("widths", list(WIDTHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_what_the_torch_ops_compute(variant, dtype, widths, monkeypatch):
    """A padded batch with holes and moved keys: the kernel's output is the torch path's (bf16: within
    its roundings; the kernel keeps fp32 where the torch path rounds keys and probabilities to bf16)."""
    cfg, backend, attn, g = _setup(5, **WIDTHS[widths])
    attn.kv_b_proj.to(dtype)
    q_nope, q_pe, pool, seqs = _decode_case(cfg, g, [45, 12, 1, 30], dtype=dtype, holes=True, moved=True)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(CPUAttention, "NATIVE_DECODE", on)
        outs[on], _, _ = _run(backend, attn, q_nope, q_pe, pool, seqs, expanded=False)
    assert outs[True].dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    scale = outs[False].abs().max().item()
    assert (outs[True].float() - outs[False].float()).abs().max().item() <= tol * scale


def test_a_switched_off_kernel_is_not_called(monkeypatch):
    from irminsul.model import native_ops as ta

    cfg, backend, attn, g = _setup(2)
    q_nope, q_pe, pool, seqs = _decode_case(cfg, g, [9, 4])
    monkeypatch.setattr(ta, "call_mla_decode", lambda *a: pytest.fail("the kernel ran"))
    backend.settings = Settings(native_decode=False)
    _run(backend, attn, q_nope, q_pe, pool, seqs, expanded=False)
    backend.settings = Settings()
    monkeypatch.setattr(CPUAttention, "NATIVE_DECODE", False)
    _run(backend, attn, q_nope, q_pe, pool, seqs, expanded=False)


def test_the_engine_decodes_the_same_tokens(tmp_path, monkeypatch):
    """Greedy generations of prompts of different lengths, several decoding together."""
    ck = make_tiny_checkpoint(tmp_path / "v3", variant="v3")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in (5, 17, 40, 9)]
    got = {}
    for on in (False, True):
        monkeypatch.setattr(CPUAttention, "NATIVE_DECODE", on)
        llm = LLM(ck, reuse="off", compile_decode=False)
        got[on] = [o.token_ids for o in llm.generate(prompts, max_tokens=12, ignore_eos=True)]
    assert got[True] == got[False]


def test_a_query_before_its_last_key_keeps_the_torch_path(monkeypatch):
    """One query in the middle of its keys (a gap computed between reused rows: the keys after it are
    there already): it must not see them, so the kernel, which reads every non-empty slot, is not
    used for its group, and the result is the reference's."""
    from irminsul.model import native_ops as ta
    from irminsul.model.attention.base import SeqAttention

    cfg, backend, attn, g = _setup(9)
    q_nope, q_pe, pool, seqs = _decode_case(cfg, g, [20, 12])
    middle = SeqAttention(np.array([5]), seqs[0].key_slots)  # position 5 of 20 keys
    calls = []
    real = ta.call_mla_decode
    monkeypatch.setattr(ta, "call_mla_decode", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(CPUAttention, "NATIVE_DECODE", True)
    got, groups, _ = _run(backend, attn, q_nope, q_pe, pool, [middle, seqs[1]], expanded=False)
    want = _reference(cfg, backend, attn, q_nope, q_pe, pool, [middle, seqs[1]])
    assert not any(gr.at_end for gr in groups) and not calls
    assert (got.double() - want).abs().max().item() < 1e-4


def test_torch_on_several_threads_runs_the_kernel_too(monkeypatch):
    """With torch on two threads the decode groups still take the kernel (it shares their work), and
    compute what they compute on one."""
    from irminsul.model import native_ops as ta

    cfg, backend, attn, g = _setup(4, **WIDTHS["bundled"])
    q_nope, q_pe, pool, seqs = _decode_case(cfg, g, [90, 41, 7], holes=True)
    monkeypatch.setattr(CPUAttention, "NATIVE_DECODE", True)
    calls = []
    real = ta.call_mla_decode
    monkeypatch.setattr(ta, "call_mla_decode", lambda *a: calls.append(torch.get_num_threads()) or real(*a))
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(_run(backend, attn, q_nope, q_pe, pool, seqs, expanded=False)[0])
    finally:
        torch.set_num_threads(threads)
    assert set(calls) == {1, 2} and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("widths", list(WIDTHS))
@pytest.mark.parametrize("layout", ["interleaved", "half"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_the_compiled_steps_operator_equals_beside(variant, widths, layout, lengths, seed):
    """`native_ops.mla_decode` (the kernel with each token's own row as one more key, as model/compiled.py's
    batched step calls it) against the torch backend's `beside` over the same rows gathered: sequences of
    different lengths padded with empty slots (a sequence with no earlier row sees its own only)."""
    from irminsul.model import native_ops
    from irminsul.model.attention.base import EMPTY_SLOT

    cfg, backend, attn, g = _setup(seed, **WIDTHS[widths])
    backend.rotary.out_layout = layout
    b, t = len(lengths), max(max(lengths), 1)
    pool = torch.randn(1 + sum(lengths) + 3, cfg.row_width, generator=g)
    slots = torch.full((b, t), EMPTY_SLOT, dtype=torch.long)
    at = 1
    for i, n in enumerate(lengths):
        slots[i, :n] = torch.arange(at, at + n)
        at += n
    h = cfg.num_attention_heads
    q_nope = torch.randn(b, h, cfg.qk_nope_head_dim, generator=g)
    pos = torch.tensor(lengths)
    cos_tab, sin_tab = backend.rotary.table(t + 1, "cpu")
    q_cos_sin = (cos_tab[pos], sin_tab[pos])
    q_pe = torch.randn(b, h, cfg.qk_rope_head_dim, generator=g)
    new = torch.randn(b, cfg.row_width, generator=g)
    visible = torch.arange(t)[None, :] < pos[:, None]
    want = backend.beside(attn, q_nope, q_pe, pool[slots], new, cos_tab[:t], sin_tab[:t], q_cos_sin, visible)
    got = backend.beside_native(attn, q_nope, q_pe, pool, slots, new, cos_tab[:t], sin_tab[:t], q_cos_sin)
    assert native_ops.available()
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
