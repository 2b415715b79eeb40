"""Expanded prefill attention through the native kernel (model/native/prefill_attention.c,
`CPUAttention.NATIVE_PREFILL`): against tests/model/test_attention_flash.py's float64 dense reference
and against SDPA's path it replaces, for causal prompts, padded batches, chunks after earlier rows,
holes and moved keys, at widths that reach each of its tiles and their remainders; where it does not
run (bf16, switched off, a build without its vector tiles) SDPA's path does; on each build this CPU
executes (tests/model/native_variants.py: the AVX-512 and AVX2 tiles, the plain loops); and the engine's
tokens are the same with and without it."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from irminsul import LLM
from irminsul.model import kernel_choice, native, native_ops
from irminsul.model.attention.cpu import CPUAttention
from irminsul.model.settings import Settings
from irminsul.model.tiny import make_tiny_checkpoint
from tests.model.native_variants import variant  # noqa: F401 (a fixture)
from tests.model.test_attention_flash import CASES, _case, _reference, _run, _setup

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="the native kernels need a C compiler")


@pytest.fixture
def any_build(variant, monkeypatch):
    """`variant`'s build, taken for every float32 expanded group even where the engine would not take it
    (a build without the vector tiles: SDPA is faster than its plain loops)."""
    if not native.library().irm_vectorised():
        monkeypatch.setattr(CPUAttention, "native_prefill", lambda self, kv, keys: True)
    return variant


# the test models' widths (q·k 24, v 16: one masked value vector), the bundled model's (48 / 48: three
# vectors), V2-Lite's (192 / 128, 16 heads: two 64-wide value tiles) and a v wider than q·k (24 / 40)
WIDTHS = {
    "tiny": {},
    "bundled": dict(qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=48),
    "v2lite": dict(
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=64,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    "wide_v": dict(v_head_dim=40),
}


def _spy(monkeypatch) -> list:
    calls = []
    real = native_ops.call_prefill_attention
    monkeypatch.setattr(native_ops, "call_prefill_attention", lambda *a: calls.append(1) or real(*a))
    return calls


# spans (start, n): n queries after `start` earlier rows; up to 110 keys (two key blocks of 64) and 60
# queries (two superblocks of 48), the diagonal anywhere in a block
@pytest.mark.parametrize("widths", list(WIDTHS))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    spans=st.lists(st.tuples(st.integers(0, 70), st.integers(2, 60)), min_size=1, max_size=3),
    holes=st.booleans(),
    moved=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_equals_the_dense_reference(any_build, widths, spans, holes, moved, seed):
    cfg, backend, attn, g = _setup(seed, **WIDTHS[widths])
    q_nope, q_pe, pool, seqs = _case(cfg, g, spans, holes=holes, moved=moved)
    want = _reference(cfg, backend, attn, q_nope, q_pe, pool, seqs)
    with pytest.MonkeyPatch.context() as mp:
        calls = _spy(mp)
        got, _, _ = _run(backend, attn, q_nope, q_pe, pool, seqs)
    assert calls  # (the kernel ran)
    assert got.shape == want.shape
    assert (got.double() - want).abs().max().item() < 2e-5


@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_computes_what_sdpa_computes(any_build, name, monkeypatch):
    spans, kw = CASES[name]
    cfg, backend, attn, g = _setup(seed=4, **WIDTHS["bundled"])
    q_nope, q_pe, pool, seqs = _case(cfg, g, spans, **kw)
    calls = _spy(monkeypatch)
    new, _, kernels = _run(backend, attn, q_nope, q_pe, pool, seqs)
    assert calls and not any("scaled_dot_product" in k for k in kernels)
    monkeypatch.setattr(CPUAttention, "NATIVE_PREFILL", False)
    monkeypatch.setattr(CPUAttention, "native_prefill", lambda self, kv, keys: False)
    old, _, old_kernels = _run(backend, attn, q_nope, q_pe, pool, seqs)
    assert len(calls) == 1 and any("scaled_dot_product" in k for k in old_kernels)
    assert (new - old).abs().max().item() < 1e-5


def test_a_query_row_sees_no_key_after_its_position(monkeypatch):
    """Changing the keys after a query's position changes nothing of its output (the causal mask inside
    the key blocks), and changing a key before it does."""
    cfg, backend, attn, g = _setup(seed=6, **WIDTHS["bundled"])
    q_nope, q_pe, pool, seqs = _case(cfg, g, [(0, 100)])
    base, _, _ = _run(backend, attn, q_nope, q_pe, pool, seqs)
    slots = seqs[0].key_slots
    later = pool.clone()
    later[torch.from_numpy(slots[71:])] += 5.0
    moved, _, _ = _run(backend, attn, q_nope, q_pe, later, seqs)
    assert torch.equal(moved[:71], base[:71]) and not torch.allclose(moved[71:], base[71:])


@pytest.mark.parametrize("why", ["bf16", "switched off", "flag"])
def test_where_it_does_not_run_sdpa_does(why, monkeypatch):
    cfg, backend, attn, g = _setup(seed=7)
    dtype = torch.bfloat16 if why == "bf16" else torch.float32
    if why == "bf16":
        attn.kv_b_proj.to(torch.bfloat16)
    q_nope, q_pe, pool, seqs = _case(cfg, g, [(10, 20)], dtype=dtype)
    monkeypatch.setattr(native_ops, "call_prefill_attention", lambda *a: pytest.fail("the kernel ran"))
    monkeypatch.setattr(CPUAttention, "widen_prefill", lambda self: False)  # (bf16: measured slower widened)
    if why == "switched off":
        backend.settings = Settings(native_prefill=False)
    if why == "flag":
        monkeypatch.setattr(CPUAttention, "NATIVE_PREFILL", False)
    _, _, kernels = _run(backend, attn, q_nope, q_pe, pool, seqs)
    assert any("scaled_dot_product" in k for k in kernels)


def test_the_engine_prefills_the_same_tokens(tmp_path, monkeypatch):
    """Three prompts in chunks of 48 rows (causal first chunks, later ones after earlier rows, padded
    groups), greedy, with and without the kernel: the same tokens, log-probs within float32's roundings."""
    path = make_tiny_checkpoint(tmp_path / "c", "v3", num_hidden_layers=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, n).tolist() for n in (130, 61, 97)]
    calls = _spy(monkeypatch)
    out = {}
    for on in (True, False):
        monkeypatch.setattr(CPUAttention, "NATIVE_PREFILL", on)
        llm = LLM(path, compile_decode=False, max_prefill_tokens=48)
        out[on] = llm.generate(prompts, max_tokens=4, ignore_eos=True, logprobs=0)
        if on:
            assert calls
            n = len(calls)
    assert len(calls) == n  # (not called with the flag off)
    assert [o.token_ids for o in out[True]] == [o.token_ids for o in out[False]]
    err = max(abs(a.logprob - b.logprob) for x, y in zip(out[True], out[False]) for a, b in zip(x.logprobs, y.logprobs))
    assert err < 1e-4, err


def test_a_build_without_vector_tiles_keeps_sdpa(monkeypatch):
    """The plain-loops build says so (irm_vectorised), and the engine then keeps SDPA for it."""
    if "x86-64" not in native.variants():
        pytest.skip("builds for x86-64")
    lib = native.library("x86-64")
    assert lib is not None and not lib.irm_vectorised()
    monkeypatch.setattr(native, "library", lambda variant=None: lib)
    cfg, backend, attn, g = _setup(seed=8, **WIDTHS["wide_v"])
    assert not backend.native_prefill(torch.zeros(1), torch.zeros(1))


def test_bad_views_are_refused():
    x = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="float32"):
        native_ops.call_prefill_attention(
            x.double(),
            x,
            x,
            x[:, :, 0],
            x,
            torch.ones(1, 4, dtype=torch.int64),
            torch.arange(4)[None],
            torch.tensor([4]),
            1.0,
        )
    with pytest.raises(ValueError, match="sizes"):  # (a k_r of other length: never a read past its end)
        native_ops.call_prefill_attention(
            x, x, x, x[:, :3, 0], x, torch.ones(1, 4, dtype=torch.int64), torch.arange(4)[None], torch.tensor([4]), 1.0
        )
    strided = torch.zeros(1, 4, 8, 2).transpose(2, 3)  # [1, 4, 2, 8], its last dimension 2 apart
    with pytest.raises(ValueError, match="contiguous"):
        native_ops.call_prefill_attention(
            strided,
            x,
            x,
            x[:, :, 0],
            x,
            torch.ones(1, 4, dtype=torch.int64),
            torch.arange(4)[None],
            torch.tensor([4]),
            1.0,
        )


def test_bf16_groups_widened_for_the_kernel_equal_the_reference(any_build, monkeypatch):
    """Where widening was measured faster, a bf16 group runs the kernel on float32 copies: the dense
    reference's values within bf16's rounding of the output (one rounding, not SDPA's bf16 sums)."""
    cfg, backend, attn, g = _setup(seed=11, **WIDTHS["bundled"])
    attn.kv_b_proj.to(torch.bfloat16)
    q_nope, q_pe, pool, seqs = _case(cfg, g, [(40, 25), (0, 30)], holes=True, dtype=torch.bfloat16)
    want = _reference(cfg, backend, attn, q_nope, q_pe, pool, seqs)
    monkeypatch.setattr(CPUAttention, "widen_prefill", lambda self: True)
    calls = _spy(monkeypatch)
    got, _, _ = _run(backend, attn, q_nope, q_pe, pool, seqs)
    assert calls and got.dtype == torch.bfloat16
    err = (got.double() - want).abs()
    assert (err <= 2 * torch.finfo(torch.bfloat16).eps * want.abs() + 1e-2).all(), err.max().item()


def test_widening_is_measured_once_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setattr(kernel_choice, "_memory", {})
    cfg, backend, attn, g = _setup(seed=12, **WIDTHS["bundled"])
    timed = []
    real = CPUAttention._time_widening
    monkeypatch.setattr(CPUAttention, "_time_widening", lambda self: timed.append(1) or real(self))
    first = backend.widen_prefill()
    assert backend.widen_prefill() == first and len(timed) == 1
    entry = next(iter(kernel_choice._read_cache(tmp_path / "kernels.json").values()))
    assert entry["widen"] == (entry["widened"] * kernel_choice.WIDEN_GAIN < entry["sdpa"])


def test_a_bf16_model_times_the_widening_when_it_loads_not_in_a_request(tmp_path, monkeypatch):
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setattr(kernel_choice, "_memory", {})
    timed = []
    real = CPUAttention._time_widening
    monkeypatch.setattr(CPUAttention, "_time_widening", lambda self: timed.append(1) or real(self))
    monkeypatch.setenv("IRMINSUL_KERNEL_CHOICE", "measured")
    llm = LLM(make_tiny_checkpoint(tmp_path / "c", "v3"), dtype="bfloat16", compile_decode=False)
    assert timed == [1]
    llm.generate([list(range(3, 250))], max_tokens=2, ignore_eos=True)  # (an expanded bf16 prefill)
    assert timed == [1]
