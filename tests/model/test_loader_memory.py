"""Weights loaded in the checkpoint's own dtype are copies in memory of their own, not views of the
safetensors file's mapping (model/loader.py `owned`): such a view was read slower (the realistic
checkpoint's bf16 LM head, kept as loaded, 73 ms a one-row product against its copy's 46) and was
not aligned to a cache line."""

import sys

import pytest
import torch

from irminsul.model.loader import load_model
from irminsul.model.tiny import make_tiny_checkpoint


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
@pytest.mark.parametrize("pack", [False, True])
def test_no_weight_is_a_view_of_the_file(tmp_path, pack):
    ck = make_tiny_checkpoint(tmp_path / "v2")
    model = load_model(ck, dtype="float32", pack=pack)  # (the tiny checkpoint is stored float32: `.to` copies nothing)
    files = [str(p) for p in ck.glob("*.safetensors")]
    with open("/proc/self/maps") as f:
        mapped = [line for line in f if any(name in line for name in files)]
    assert not mapped
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.numel() * t.element_size() >= 64:
            assert t.data_ptr() % 64 == 0 or t.untyped_storage().data_ptr() % 64 == 0, name
    ids = torch.arange(10)
    assert torch.isfinite(model.logits(model.prefill(model.new_rows(16), ids.tolist(), list(range(10))))).all()
