"""Expanded prefill attention on SDPA's flash kernel (`CPUAttention.EQUAL_WIDTHS`: v padded with
zeros to the q·k width on a CPU): against a float64 dense reference built here from the pool, for
causal groups, padded batches, chunks after earlier rows (explicit masks), holes and moved RoPE
positions; against the old unpadded (math kernel) call through the whole engine, V3.2's indexer
included; and that the flash kernel is the one that runs."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import profile

from irminsul import LLM
from irminsul.model.attention.base import EMPTY_SLOT, SeqAttention
from irminsul.model.attention.cpu import CPUAttention
from irminsul.model.config import ModelConfig
from irminsul.model.rope import Rotary
from irminsul.model.tiny import make_tiny_checkpoint, tiny_config

# q·k 24 wide, v 16: unequal, as in every MLA checkpoint (192 / 128 at full size)
DIMS = dict(
    num_attention_heads=3,
    num_key_value_heads=3,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)
FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


@pytest.fixture(autouse=True)
def _sdpa(monkeypatch):
    """These test SDPA's path (bf16 models, torch on several threads and CPUs without AVX-512 take it);
    tests/model/test_native_prefill.py tests the native kernel that float32 on one thread takes."""
    monkeypatch.setattr(CPUAttention, "NATIVE_PREFILL", False)


def _setup(seed=0, **dims):
    cfg = ModelConfig.from_dict(tiny_config("v3", **{**DIMS, **dims}))
    g = torch.Generator().manual_seed(seed)
    kv_b = torch.nn.Linear(
        cfg.kv_lora_rank, cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
    )
    with torch.no_grad():
        kv_b.weight.copy_(torch.randn(kv_b.weight.shape, generator=g) * 0.2)
    return cfg, CPUAttention(cfg, Rotary(cfg.rope)), SimpleNamespace(kv_b_proj=kv_b), g


def _reference(cfg, backend, attn, q_nope, q_pe, pool, seqs):
    """Dense float64 attention, one sequence at a time: keys expanded from the pool rows, k_r
    encoded at each key's RoPE position, a query at position p sees the non-empty keys at <= p."""
    r, h, nope = cfg.kv_lora_rank, cfg.num_attention_heads, cfg.qk_nope_head_dim
    w = attn.kv_b_proj.weight.double().view(h, nope + cfg.v_head_dim, r)
    out, at = [], 0
    for s in seqs:
        n, t = len(s.q_positions), len(s.key_slots)
        rows = pool[torch.from_numpy(s.key_slots)].float()
        rope_pos = torch.from_numpy(s.key_rope if s.key_rope is not None else np.arange(t))
        cos, sin = backend.rotary.cos_sin(rope_pos)
        k_r = backend.rotary.encode_cached(rows[:, r : cfg.latent_width], cos, sin).double()  # [T, rope]
        c = rows[:, :r].double()
        k_nope, v = torch.einsum("tr,hdr->htd", c, w[:, :nope]), torch.einsum("tr,hdr->htd", c, w[:, nope:])
        q = torch.cat([q_nope[at : at + n], q_pe[at : at + n]], -1).double().transpose(0, 1)  # [H, n, qk]
        k = torch.cat([k_nope, k_r[None].expand(h, t, -1)], -1)
        ok = (torch.arange(t)[None] <= torch.from_numpy(s.q_positions)[:, None]) & torch.from_numpy(
            s.key_slots != EMPTY_SLOT
        )[None]
        p = (q @ k.transpose(1, 2) * cfg.softmax_scale).masked_fill(~ok, float("-inf")).softmax(-1)
        out.append((p @ v).transpose(0, 1))
        at += n
    return torch.cat(out)


def _run(backend, attn, q_nope, q_pe, pool, seqs, expanded=True):
    offsets = np.cumsum([0] + [len(s.q_positions) for s in seqs])[:-1].tolist()
    groups = [dataclasses.replace(g, expanded=expanded) for g in backend.plan(seqs, offsets, "cpu")]
    with profile() as prof:
        out = backend.forward(attn, q_nope, q_pe, pool, groups)
    kernels = {e.key for e in prof.key_averages()}
    return out, groups, kernels


def _case(cfg, g, spans, holes=False, moved=False, dtype=torch.float32):
    """Sequences with `spans` [(start, n)]: queries at start..start+n-1 over keys 0..start+n-1, each
    key in a random pool slot; `holes` leaves some earlier keys empty, `moved` reads keys at other
    RoPE positions (a reused chunk)."""
    total = sum(s + n for s, n in spans)
    pool = (torch.randn(total + 1, cfg.latent_width, generator=g)).to(dtype)
    pool[EMPTY_SLOT] = 0
    free = (torch.randperm(total, generator=g) + 1).numpy()
    seqs, at = [], 0
    for start, n in spans:
        slots = free[at : at + start + n].copy()
        at += start + n
        if holes and start > 2:
            slots[1:start:3] = EMPTY_SLOT
        rope = np.arange(start + n) + (7 if moved else 0)
        seqs.append(SeqAttention(np.arange(start, start + n), slots, rope if moved else None))
    m = sum(n for _, n in spans)
    h = cfg.num_attention_heads
    q_nope = torch.randn(m, h, cfg.qk_nope_head_dim, generator=g).to(dtype)
    q_pe = torch.randn(m, h, cfg.qk_rope_head_dim, generator=g).to(dtype)
    return q_nope, q_pe, pool, seqs


CASES = {  # spans (start, n) of one group
    "causal": ([(0, 37)], {}),
    "causal, padded batch": ([(0, 37), (0, 33), (0, 30)], {}),
    "chunk after earlier rows": ([(40, 25)], {}),
    "padded batch of chunks": ([(40, 25), (30, 20), (35, 24)], {}),
    "holes and moved keys": ([(40, 25), (30, 22)], dict(holes=True, moved=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flash_path_equals_a_dense_reference(name):
    spans, kw = CASES[name]
    cfg, backend, attn, g = _setup()
    q_nope, q_pe, pool, seqs = _case(cfg, g, spans, **kw)
    want = _reference(cfg, backend, attn, q_nope, q_pe, pool, seqs)
    got, groups, kernels = _run(backend, attn, q_nope, q_pe, pool, seqs)
    assert len(groups) == 1 and groups[0].causal == name.startswith("causal")
    assert FLASH in kernels and MATH not in kernels, sorted(k for k in kernels if "attention" in k)
    assert got.shape == want.shape
    assert (got.double() - want).abs().max().item() < 2e-5
    absorbed, _, _ = _run(backend, attn, q_nope, q_pe, pool, seqs, expanded=False)  # the other form agrees
    assert (absorbed.double() - want).abs().max().item() < 2e-5


@pytest.mark.parametrize("name", list(CASES))
def test_flash_path_equals_the_old_math_path(name, monkeypatch):
    spans, kw = CASES[name]
    cfg, backend, attn, g = _setup(seed=1)
    q_nope, q_pe, pool, seqs = _case(cfg, g, spans, **kw)
    new, _, kernels = _run(backend, attn, q_nope, q_pe, pool, seqs)
    monkeypatch.setattr(CPUAttention, "EQUAL_WIDTHS", False)
    old, _, old_kernels = _run(backend, attn, q_nope, q_pe, pool, seqs)
    assert FLASH in kernels and MATH in old_kernels and FLASH not in old_kernels  # (else the test tests nothing)
    assert (new - old).abs().max().item() < 1e-5


def test_bf16_flash_path_is_no_further_from_the_reference_than_the_math_path(monkeypatch):
    cfg, backend, attn, g = _setup(seed=2)
    attn.kv_b_proj.to(torch.bfloat16)
    q_nope, q_pe, pool, seqs = _case(cfg, g, [(40, 25), (0, 30)], holes=True, dtype=torch.bfloat16)
    want = _reference(cfg, backend, attn, q_nope, q_pe, pool, seqs)
    new = (_run(backend, attn, q_nope, q_pe, pool, seqs)[0].double() - want).abs().max().item()
    monkeypatch.setattr(CPUAttention, "EQUAL_WIDTHS", False)
    old = (_run(backend, attn, q_nope, q_pe, pool, seqs)[0].double() - want).abs().max().item()
    assert new < 0.05 and new <= 1.5 * old + 1e-3, (new, old)


def test_a_v_wider_than_qk_pads_q_and_k_instead():
    cfg, backend, attn, g = _setup(seed=3, v_head_dim=40)  # q·k 24, v 40
    q_nope, q_pe, pool, seqs = _case(cfg, g, [(30, 20), (0, 26)])
    want = _reference(cfg, backend, attn, q_nope, q_pe, pool, seqs)
    got, _, kernels = _run(backend, attn, q_nope, q_pe, pool, seqs)
    assert FLASH in kernels and (got.double() - want).abs().max().item() < 2e-5


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 70), st.integers(2, 40)), min_size=1, max_size=3),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_any_spans_equal_the_reference(spans, holes, seed):
    cfg, backend, attn, g = _setup(seed=seed)
    q_nope, q_pe, pool, seqs = _case(cfg, g, spans, holes=holes)
    want = _reference(cfg, backend, attn, q_nope, q_pe, pool, seqs)
    got, _, _ = _run(backend, attn, q_nope, q_pe, pool, seqs)
    assert (got.double() - want).abs().max().item() < 2e-5


@pytest.mark.parametrize("variant", ["v3", "v32"])
def test_chunked_batched_prefill_through_the_engine_equals_the_old_math_path(tmp_path, variant, monkeypatch):
    """Three prompts prefilled together in chunks of 48 rows (causal first chunks, masked later ones,
    padded groups; V3.2: the indexer's top-k masks), flash against the unpadded call."""
    path = make_tiny_checkpoint(tmp_path / "c", variant, num_hidden_layers=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, n).tolist() for n in (130, 61, 97)]
    kw = dict(max_tokens=3, ignore_eos=True, logprobs=0)

    def run():
        llm = LLM(path, compile_decode=False, max_prefill_tokens=48)
        with profile() as prof:
            outs = llm.generate(prompts, **kw)
        return outs, {e.key for e in prof.key_averages()}

    new, kernels = run()
    monkeypatch.setattr(CPUAttention, "EQUAL_WIDTHS", False)
    old, old_kernels = run()
    assert FLASH in kernels and MATH not in kernels and MATH in old_kernels
    assert [o.token_ids for o in new] == [o.token_ids for o in old]
    err = max(abs(a.logprob - b.logprob) for x, y in zip(new, old) for a, b in zip(x.logprobs, y.logprobs))
    assert err < 1e-4, err


def test_the_absorbed_or_expanded_rule_counts_the_padded_width(monkeypatch):
    """At MLA's widths (q·k 192, v 128, r 512) padding v makes expanding dearer: 180 queries over
    4k keys expand unpadded (from m = 171) and stay absorbed padded (from m = 187)."""
    from irminsul.model.attention.reference import expand_is_cheaper

    cfg = ModelConfig.from_dict(
        tiny_config(
            "v3",
            num_attention_heads=16,
            num_key_value_heads=16,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        )
    )
    first = [next(m for m in range(2, 1000) if expand_is_cheaper(cfg, m, 4096, padded)) for padded in (False, True)]
    assert first == [171, 187]
    backend = CPUAttention(cfg, Rotary(cfg.rope))
    seqs = [SeqAttention(np.arange(4096 - 180, 4096), np.arange(1, 4097))]
    assert not backend.plan(seqs, [0], "cpu")[0].expanded
    monkeypatch.setattr(CPUAttention, "EQUAL_WIDTHS", False)
    assert backend.plan(seqs, [0], "cpu")[0].expanded
