"""A stand-in for the GQA twin when its trained checkpoint is absent: the twin's architecture
(`irminsul.research.train.arch`, shaped like the given MLA reference model) with seeded random weights.

Good for what does not depend on training (FLOPs, bytes, wall time, RoPE's effect on K); never
reported as the trained twin.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import torch

from irminsul.research.eval.shapes import read_config


def twin_config(mla_dir: str | Path):
    """The transformers LlamaConfig of the MLA reference model's GQA twin."""
    from irminsul.research.train.arch import ReferenceShape, hf_config
    from irminsul.research.train.tokenizer import load_tokenizer

    raw = read_config(mla_dir)
    shape = dataclasses.replace(
        ReferenceShape(),
        hidden=raw["hidden_size"],
        layers=raw["num_hidden_layers"],
        heads=raw["num_attention_heads"],
        max_positions=raw["max_position_embeddings"],
        dense_intermediate=raw["intermediate_size"],
    )
    return hf_config("gqa", load_tokenizer(Path(mla_dir)), shape)


def random_twin(mla_dir: str | Path, seed: int = 0) -> Path:
    """Save a seeded random-init twin to a temporary folder and return it."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    out = Path(tempfile.mkdtemp(prefix="irminsul-twin-"))
    LlamaForCausalLM(twin_config(mla_dir)).save_pretrained(out)
    return out
