"""Attention over the latent pool: the interface every backend implements (base.py) and its two
implementations, torch.py (the reference, any device) and triton.py (a GPU, or Triton's interpreter).
The triton backend is imported only when asked for (`backend`): the torch one needs no triton."""

from irminsul.model.attention.base import (EMPTY_SLOT, PADDING_SLACK, AttentionBackend, SeqAttention, consecutive,
                                           dsa_selection)
from irminsul.model.attention.torch import AttentionGroup, TorchAttention, expand_is_cheaper

__all__ = ["EMPTY_SLOT", "PADDING_SLACK", "AttentionBackend", "AttentionGroup", "SeqAttention", "TorchAttention",
           "backend", "consecutive", "dsa_selection", "expand_is_cheaper"]


def backend(name: str, cfg, rotary) -> AttentionBackend:
    """The backend called `name` ("torch" or "triton") for a model's config and rotary class."""
    if name == "torch":
        return TorchAttention(cfg, rotary)
    if name == "triton":
        from irminsul.model.attention.triton import TritonAttention

        return TritonAttention(cfg, rotary)
    from irminsul.errors import RequestError

    raise RequestError(f"attention_backend={name!r}: choose torch or triton")
