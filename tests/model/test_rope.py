"""δ-rotation of a cached k_r equals encoding at the target position (docs/design.md, section 2)."""

import math

import numpy as np
import pytest
import torch

from irminsul.model.config import RopeConfig
from irminsul.model.rope import Rotary, inv_freq


def rotate_reference(k_r: np.ndarray, delta: int, rope: RopeConfig) -> np.ndarray:
    """The oracle for `Rotary.rotate`: one pair at a time, in float64 Python math."""
    freqs = inv_freq(rope).double().numpy()
    layout = rope.cache_layout
    out = np.array(k_r, dtype=np.float64, copy=True)
    flat = out.reshape(-1, rope.dim)
    half = rope.dim // 2
    for row in flat:
        for i in range(half):
            ia, ib = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, i + half)
            a, b = row[ia], row[ib]
            c, s = math.cos(delta * freqs[i]), math.sin(delta * freqs[i])
            row[ia], row[ib] = a * c - b * s, b * c + a * s
    return out


STYLES = ["v2", "v3_interleave", "v3_half"]
V2_LITE_YARN = dict(
    kind="yarn", factor=40.0, original_max_position=4096, beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707
)
DELTAS = [1, -1, 7, -31, 100, -1000, 4096, -12345, 65536, 100_000, -100_000]


def _rope(style, yarn, dim=64):
    return RopeConfig(dim=dim, theta=10000.0, style=style, **(V2_LITE_YARN if yarn else {}))


def _rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("yarn", [False, True])
def test_rotation_equals_encoding_at_target(style, yarn):
    rot = Rotary(_rope(style, yarn))
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(256, 64, generator=g)  # fresh k_r projections, checkpoint layout
    src = torch.randint(0, 50_000, (256,), generator=g) + 100_000  # keep p + δ >= 0
    for delta in DELTAS:
        cached = rot.apply(raw, src)
        target = rot.apply(raw, src + delta)
        assert _rel_l2(rot.rotate(cached, delta), target) <= 1e-6
        cached16 = rot.apply(raw.bfloat16(), src)
        target16 = rot.apply(raw.bfloat16(), src + delta)
        moved16 = rot.rotate(cached16, delta)
        assert moved16.dtype == torch.bfloat16
        assert _rel_l2(moved16, target16) <= 4.7e-3


def test_rotation_of_heads_and_per_row_deltas():
    rot = Rotary(_rope("v2", True))
    raw = torch.randn(10, 3, 64)
    pos = torch.arange(10) * 37
    deltas = torch.arange(10) * 11 - 40
    moved = rot.rotate(rot.apply(raw, pos), deltas)
    assert _rel_l2(moved, rot.apply(raw, pos + deltas)) <= 1e-6


@pytest.mark.parametrize("style", STYLES)
def test_fast_rotation_matches_slow_reference(style):
    cfg = _rope(style, True, dim=16)
    rot = Rotary(cfg)
    k = torch.randn(5, 16)
    for delta in (3, -250, 99_999):
        ref = rotate_reference(k.numpy(), delta, cfg)
        assert np.abs(rot.rotate(k, delta).double().numpy() - ref).max() < 1e-5


def test_unit_rotation_never_applies_the_attention_factor_twice():
    cfg = RopeConfig(
        dim=8, theta=10000.0, kind="yarn", factor=40.0, original_max_position=64, mscale=1.0, mscale_all_dim=0.5
    )
    rot = Rotary(cfg)
    assert rot.attention_factor != 1.0
    k = torch.randn(4, 8)
    assert torch.allclose(rot.rotate(k, 0), k)
    assert torch.allclose(rot.rotate(k, 123).norm(dim=-1), k.norm(dim=-1), rtol=1e-6)


def test_v2_lite_softmax_scale():
    from irminsul.model.config import ModelConfig

    raw = dict(
        model_type="deepseek_v2",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=163840,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    cfg = ModelConfig.from_dict(raw)
    assert abs(cfg.softmax_scale - 0.114721) < 1e-6  # docs/design.md: V2-Lite, not 192^-0.5 = 0.0722
    assert cfg.row_width == 576


def test_fast_encodings_equal_the_pairwise_formula_for_both_layouts():
    """The fast paths (a complex multiply on interleaved float32 pairs, in place on a strided view
    of gathered rows or into a new tensor, and `apply` on fresh queries) give the same bits as the
    pairwise formula a·cos − b·sin, b·cos + a·sin; the halves layout and bf16 take that formula."""
    from irminsul.model.config import RopeConfig
    from irminsul.model.rope import Rotary
    from irminsul.model.rope import encode_pairwise as pairwise

    g = torch.Generator().manual_seed(0)
    for style, dtype in (
        ("v2", torch.float32),
        ("v3_interleave", torch.float32),
        ("v3_half", torch.float32),
        ("v2", torch.bfloat16),
    ):
        rot = Rotary(RopeConfig(dim=16, theta=10000.0, style=style))
        rows = torch.randn(3, 40, 48 + 16, generator=g).to(dtype)  # [B, T, r + rope], r = 48
        cos, sin = rot.table(40)
        want = pairwise(rows[..., 48:], cos[None, :40], sin[None, :40], rot.out_layout, rot.out_layout)
        assert torch.equal(rot.encode_cached(rows[..., 48:], cos[None, :40], sin[None, :40]), want), style
        got = rows.clone()
        rot.encode_cached_(got[..., 48:], cos[None, :40], sin[None, :40])
        assert torch.equal(got[..., 48:], want) and torch.equal(got[..., :48], rows[..., :48]), style
        q = torch.randn(40, 4, 32 + 16, generator=g).to(dtype)[..., 32:]  # [n, heads, rope], strided
        pos = torch.arange(40) * 7
        c, s_ = rot.cos_sin(pos)
        want = pairwise(q, c[:, None], s_[:, None], rot.in_layout, rot.out_layout)
        assert torch.equal(rot.apply(q, pos), want), style
