"""Irminsul: MLA-native position-independent KV caching for agentic LLM serving."""

import importlib

# (imported when first named: `irminsul --help` and the other command-line paths that do not run a
# model never import torch)
_EXPORTS = {
    "bundled_model": "irminsul.bundled",
    "LLM": "irminsul.engine.llm",
    "GenerationResult": "irminsul.engine.llm",
    "Segments": "irminsul.engine.llm",
    "SamplingParams": "irminsul.engine.sampling",
    "CheckpointError": "irminsul.errors",
    "ConfigError": "irminsul.errors",
    "RequestError": "irminsul.errors",
    "UserFacingError": "irminsul.errors",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'irminsul' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
