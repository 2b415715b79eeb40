"""The rotation study measures what it claims: rounding only at layer 0, drift above it."""

import numpy as np
import pytest
import torch

from irminsul.model.config import RopeConfig
from irminsul.model.loader import load_model
from irminsul.model.rope import Rotary
from irminsul.model.tiny import make_tiny_checkpoint
from irminsul.research.eval.rotation import drift_pair, layer0_keys, random_v2_lite_keys, rotation_error


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):
    # unpacked: KeyRecorder hooks kv_a_proj_with_mqa, which a packed layer computes fused with q
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("rot") / "m", yarn=True, std=0.3), pack=False)


def test_layer0_rotation_is_exact_up_to_rounding(yarn_model):
    k = layer0_keys(yarn_model, torch.arange(5, 205))
    p = torch.arange(200) * 37
    for delta in (1, 1000, 100_000):
        assert rotation_error(yarn_model.rotary, k, p, delta, torch.float32) < 1e-6
        assert 1e-4 < rotation_error(yarn_model.rotary, k, p, delta, torch.bfloat16) < 1e-2


def test_v2_lite_shaped_rotation_error_and_a_wrong_rotary_class_fails():
    rot, k = random_v2_lite_keys(256, seed=0)
    assert k.shape == (256, 64) and rot.config.kind == "yarn" and rot.config.factor == 40
    p = torch.arange(256) * 11
    assert rotation_error(rot, k, p, 50_000, torch.float32) < 1e-6
    # The paper's TransMLA lesson: a plain base-10000 class in place of YaRN's is badly wrong.
    wrong = Rotary(RopeConfig(dim=64, theta=10000.0))
    moved = wrong.rotate(rot.apply(k, p), 50_000)
    err = float((moved - rot.apply(k, p + 50_000)).norm() / rot.apply(k, p + 50_000).norm())
    assert err > 0.1


def test_drift_is_zero_at_layer0_and_positive_above(yarn_model):
    rng = np.random.default_rng(0)
    content, a, b = (rng.integers(0, 250, n).tolist() for n in (64, 10, 90))
    parts = drift_pair(yarn_model, content, a, b)
    assert len(parts) == yarn_model.config.num_hidden_layers
    assert parts[0]["drift"] == 0.0 and parts[0]["c_kv_drift"] == 0.0
    assert all(p["rotation"] < 1e-5 for p in parts)
    assert all(p["drift"] > 1e-3 and p["c_kv_drift"] > 1e-3 for p in parts[1:])
    assert parts[1]["total"] == pytest.approx(parts[1]["drift"], rel=0.05)
