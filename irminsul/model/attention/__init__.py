"""Attention over the latent pool: the interface every backend implements (base.py) and its
implementations: reference.py (plain torch ops, any device), cpu.py (the reference with the native
kernels where they run: the default) and triton.py (a GPU, or Triton's interpreter). The triton
backend is imported only when asked for (`backend`): the others need no triton."""

from irminsul.model.attention.base import (
    EMPTY_SLOT,
    PADDING_SLACK,
    AttentionBackend,
    SeqAttention,
    consecutive,
    dsa_selection,
)
from irminsul.model.attention.cpu import CPUAttention
from irminsul.model.attention.reference import AttentionGroup, ReferenceAttention, expand_is_cheaper

__all__ = [
    "BACKENDS",
    "EMPTY_SLOT",
    "PADDING_SLACK",
    "AttentionBackend",
    "AttentionGroup",
    "CPUAttention",
    "ReferenceAttention",
    "SeqAttention",
    "backend",
    "consecutive",
    "dsa_selection",
    "expand_is_cheaper",
]

# the names `backend` takes; "torch" is the default's older name, kept for configurations that use it
BACKENDS = ("cpu", "reference", "triton")
ALIASES = {"torch": "cpu"}


def backend(name: str, cfg, rotary, settings=None) -> AttentionBackend:
    """The backend called `name` (one of BACKENDS) for a model's config, rotary class and settings (the
    switches it runs by: model/settings.py; default the environment's, read now)."""
    name = ALIASES.get(name, name)
    if name == "cpu":
        return CPUAttention(cfg, rotary, settings)
    if name == "reference":
        return ReferenceAttention(cfg, rotary, settings)
    if name == "triton":
        from irminsul.model.attention.triton import TritonAttention

        return TritonAttention(cfg, rotary, settings)
    from irminsul.errors import RequestError

    raise RequestError(f"attention_backend={name!r}: choose one of {', '.join(BACKENDS)}")
