"""DeepSeek-V4 behind the engine's model interface, so `LLM` and `irminsul serve` run it with the same
pool, scheduler and reuse modes as the MLA models.

The pool row of a V4 layer is the per-token row of `deepseek_v4.py`: the token's key = value with its rope
slice un-rotated, then its compressor's (and indexer's) pooling inputs. Layers differ in width (a sliding
layer keeps the key only), so the pool is as wide as the widest layer and a layer uses its first columns.
Nothing in a row depends on position, so the engine's content reuse (`pic`) shares rows at another
position exactly as it does for MLA; compressed entries are pooled from the rows at the reading
sequence's window alignment, and keys are rotated at read (`naive`: at the position they were computed
at, the stale baseline).

This is the reference path, not a fast one: each sequence of a step gathers its rows and runs the layers
on its own (a Python loop over sequences), and attention rebuilds every compressed entry of the sequence
each step (O(length) per layer). A batched kernel is the GPU issue's work. `pic+r` (which recomputes
the rows that deviate most, from MLA's c_KV) is not available for V4, nor is the triton backend.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from irminsul.errors import ConfigError
from irminsul.model.attention import EMPTY_SLOT, SeqAttention
from irminsul.model.deepseek_v4 import DeepseekV4ForCausalLM, load_deepseek_v4


@dataclass(frozen=True)
class V4EngineConfig:
    """What the engine, the cache and the server read of a model's config."""

    num_hidden_layers: int
    row_width: int  # the widest layer's row; narrower layers use its first columns
    max_position_embeddings: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    model_type: str = "deepseek_v4"


@dataclass
class V4Plan:
    """A step's sequences as the engine describes them (`SeqAttention`) and where their tokens sit in
    the flat batch (sequence i: rows offsets[i]:offsets[i + 1])."""

    seqs: list[SeqAttention]
    offsets: list[int]


class _Planner:
    def plan(self, seqs: list[SeqAttention], offsets: list[int], device) -> V4Plan:
        return V4Plan(list(seqs), list(offsets))


class V4Serving(nn.Module):
    def __init__(self, model: DeepseekV4ForCausalLM, eos_token_ids: tuple[int, ...] = ()):
        super().__init__()
        self.v4 = model
        cfg = model.config
        self.widths = [layer.self_attn.row_width for layer in model.model.layers]
        self.config = V4EngineConfig(cfg.num_hidden_layers, max(self.widths), cfg.max_position_embeddings,
                                     cfg.vocab_size, tuple(eos_token_ids))
        self.attention = _Planner()

    @property
    def device(self) -> torch.device:
        return self.v4.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.v4.lm_head.weight.dtype

    def set_attention_backend(self, name: str) -> None:
        if name != "torch":
            raise ConfigError(f"attention_backend={name!r}: DeepSeek-V4 runs on the torch backend only for now")

    @torch.inference_mode()
    def forward(self, batch) -> torch.Tensor:
        """The engine's ForwardBatch (its `groups` a V4Plan) -> final hidden states [N, hidden]; every
        computed token's rows are written to the pool at batch.write_slots."""
        plan: V4Plan = batch.groups
        out = None
        for i, seq in enumerate(plan.seqs):
            at = slice(plan.offsets[i], plan.offsets[i + 1])
            slots = torch.as_tensor(np.asarray(seq.key_slots), device=self.device)
            q_pos = torch.as_tensor(np.asarray(seq.q_positions), device=self.device)
            missing = slots == EMPTY_SLOT
            missing[q_pos] = False
            if bool(missing.any()):  # (the engine fills every earlier position before computing a later one)
                raise RuntimeError(f"DeepSeek-V4: positions {missing.nonzero()[:, 0].tolist()[:8]} have no row")
            rows = [batch.pool[layer, slots, :w].clone() for layer, w in enumerate(self.widths)]
            key_pos = None if seq.key_rope is None else torch.as_tensor(np.asarray(seq.key_rope), device=self.device)
            hidden = self.v4.prefill_hidden(batch.token_ids[at], q_pos, rows, key_pos)
            for layer, (w, layer_rows) in enumerate(zip(self.widths, rows)):
                batch.pool[layer, batch.write_slots[at], :w] = layer_rows[q_pos].to(batch.pool.dtype)
            if out is None:
                out = hidden.new_empty(batch.token_ids.shape[0], hidden.shape[-1])
            out[at] = hidden
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.v4.logits(hidden)


def is_v4(path: Path) -> bool:
    """Whether the checkpoint directory holds a DeepSeek-V4 config (read leniently: a broken config.json
    is reported by the MLA loader's own checks)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type") == "deepseek_v4"
    except (OSError, ValueError, AttributeError):
        return False


def load_v4_serving(path: str | Path, dtype="float32", device: str = "cpu") -> V4Serving:
    raw = json.loads((Path(path) / "config.json").read_text())
    eos = raw.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return V4Serving(load_deepseek_v4(path, dtype=dtype, device=device), eos)
