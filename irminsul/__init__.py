"""Irminsul: MLA-native position-independent KV caching for agentic LLM serving."""

from irminsul.bundled import bundled_model
from irminsul.engine.llm import LLM, GenerationResult, Segments
from irminsul.engine.sampling import SamplingParams
from irminsul.errors import CheckpointError, ConfigError, RequestError, UserFacingError

__all__ = ["LLM", "GenerationResult", "SamplingParams", "Segments", "bundled_model", "CheckpointError", "ConfigError",
           "RequestError", "UserFacingError"]
__version__ = "0.1.0"
