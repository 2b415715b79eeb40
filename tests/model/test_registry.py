"""model_type -> class through the registry, and what each family declares through `base.Model`."""

import json

import pytest

from irminsul.errors import ConfigError
from irminsul.model.base import Capabilities, Model
from irminsul.model.deepseek import DeepseekModel
from irminsul.model.loader import load_model
from irminsul.model.registry import FAMILIES, model_class
from irminsul.model.tiny import make_tiny_checkpoint


def test_every_mla_type_is_one_class_and_v4_its_own():
    from irminsul.model.v4_serving import V4Model

    for name in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "longcat_flash"):
        assert model_class(name) is DeepseekModel
    assert model_class("deepseek_v4") is V4Model
    assert set(FAMILIES) >= {"deepseek_v2", "deepseek_v4"}


def test_an_unknown_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="llama.*deepseek_v2"):
        load_model(tmp_path)


def test_the_loader_picks_the_class_and_the_model_declares_what_it_can(tmp_path):
    pytest.importorskip("transformers", minversion="5.24")
    from irminsul.model.deepseek_v4 import make_tiny_v4_checkpoint

    mla = load_model(make_tiny_checkpoint(tmp_path / "v2", "v2"))
    v32 = load_model(make_tiny_checkpoint(tmp_path / "v32", "v32"))
    v4 = load_model(make_tiny_v4_checkpoint(tmp_path / "v4", seed=1))
    assert isinstance(mla, Model) and isinstance(v4, Model)
    assert mla.capabilities == Capabilities(backend="cpu", fresh_rows=True, indexer=False)
    assert v32.capabilities.indexer
    assert v4.capabilities == Capabilities(backend="v4-reference", fresh_rows=False)
    from irminsul.model import compiled

    assert compiled.resolve(v4, None) is None  # no compiled step covers it: eager
    with pytest.raises(ValueError, match="MLA"):
        compiled.resolve(v4, True)
