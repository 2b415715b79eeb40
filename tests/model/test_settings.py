"""The model layer's switches (model/settings.py): read once, when a model is loaded, and held by it."""

import dataclasses

import pytest

from irminsul.model.attention import CPUAttention
from irminsul.model.layers import MLP, MoE, RMSNorm
from irminsul.model.loader import load_model
from irminsul.model.settings import VARIABLES, Settings, settings


def test_a_snapshot_reads_every_variable_and_is_frozen(tmp_path):
    assert Settings() == Settings.from_env({})  # (the defaults: an environment that sets none)
    env = {
        "IRMINSUL_NATIVE_MOE": "0",
        "IRMINSUL_GEMV": "1",
        "IRMINSUL_KERNEL_CHOICE": "fixed",
        "IRMINSUL_KERNEL_COPIES": "0.5",
        "IRMINSUL_KERNEL_CACHE": str(tmp_path / "k.json"),
        "XDG_CACHE_HOME": str(tmp_path),
        "TRITON_INTERPRET": "1",
    }
    got = Settings.from_env(env)
    assert not got.native_moe and got.gemv and got.native_decode and got.triton_interpret
    assert (got.kernel_choice, got.kernel_copies) == ("fixed", 0.5)
    assert got.kernel_cache == tmp_path / "k.json" and got.cache_home == tmp_path
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.native_moe = True  # type: ignore[misc]
    assert set(VARIABLES) == {f.name for f in dataclasses.fields(Settings)}


def test_the_process_view_reads_the_environment_when_asked(monkeypatch):
    monkeypatch.setenv("IRMINSUL_NATIVE_MARCH", "x86-64")
    assert settings.native_march == "x86-64"
    monkeypatch.delenv("IRMINSUL_NATIVE_MARCH")
    assert settings.native_march is None
    with pytest.raises(AttributeError):
        settings.no_such_switch  # noqa: B018


def test_a_loaded_model_keeps_what_it_was_loaded_with(tiny_dir, monkeypatch):
    """Its layers, attention backend and kernel choices hold the model's one snapshot: a variable
    changed after the load changes none of them."""
    monkeypatch.setenv("IRMINSUL_NATIVE_MOE", "0")
    monkeypatch.setenv("IRMINSUL_NATIVE_ELEMENTWISE", "0")
    model = load_model(tiny_dir)
    monkeypatch.setenv("IRMINSUL_NATIVE_MOE", "1")
    monkeypatch.setenv("IRMINSUL_NATIVE_ELEMENTWISE", "1")
    snapshot = model.settings
    assert not snapshot.native_moe and not snapshot.native_elementwise
    held = [m for m in model.modules() if isinstance(m, (RMSNorm, MLP, MoE))]
    assert held and all(m.settings is snapshot for m in held)
    assert isinstance(model.attention, CPUAttention) and model.attention.settings is snapshot
    assert model.kernel_choices.settings is snapshot
    moe = next(m for m in held if isinstance(m, MoE))
    assert moe.native_kernel(moe.experts[0].gate_proj.weight.dtype) is None  # (switched off at load)
    model.set_attention_backend("reference")
    assert model.attention.settings is snapshot


def test_a_model_takes_the_settings_it_is_handed(tiny_dir):
    handed = Settings(native_decode=False, kernel_choice="fixed")
    model = load_model(tiny_dir, settings=handed)
    assert model.settings is handed and model.attention.settings is handed
    assert model.kernel_choices.kernels == "fixed"
