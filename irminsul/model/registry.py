"""model_type -> the class that serves it. A family is one module and one line here; its class
implements `base.Model` and loads itself (`cls.load(path, dtype, device, pack)`). Modules are imported
when a checkpoint asks for them, so a family's optional dependencies cost the others nothing."""

from __future__ import annotations

import importlib

from irminsul.errors import ConfigError

_MLA = ("irminsul.model.deepseek", "DeepseekModel")
FAMILIES: dict[str, tuple[str, str]] = {
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "deepseek_v32": _MLA,
    "glm4_moe_lite": _MLA,
    "longcat_flash": _MLA,
    "deepseek_v4": ("irminsul.model.v4_serving", "V4Model"),
}


def model_class(model_type: str | None) -> type:
    """The class registered for `model_type`, else a ConfigError naming the ones that are."""
    if model_type not in FAMILIES:
        raise ConfigError(
            f"config.json: model_type={model_type!r} is not supported; Irminsul serves {', '.join(FAMILIES)}"
        )
    module, name = FAMILIES[model_type]
    return getattr(importlib.import_module(module), name)
