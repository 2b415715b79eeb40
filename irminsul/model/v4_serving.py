"""DeepSeek-V4 as a model family of the engine (`base.Model`), so `LLM` and `irminsul serve` run it with the
same pool, scheduler and reuse modes as the MLA models.

The pool row of a V4 layer is the per-token row of `deepseek_v4.py`: the token's key = value with its rope
slice un-rotated, then its compressor's (and indexer's) pooling inputs. Layers differ in width (a sliding
layer keeps the key only), so the pool is as wide as the widest layer and a layer uses its first columns.
Nothing in a row depends on position, so the engine's content reuse (`pic`) shares rows at another
position exactly as it does for MLA; compressed entries are pooled from the rows at the reading
sequence's window alignment, and keys are rotated at read (`naive`: at the position they were computed
at, the stale baseline).

This is the reference path, not a fast one: V4's attention re-pools each sequence's compressed entries
from its own rows (O(length) per layer), so its backend plans the step per sequence (`V4Plan`) and the
forward runs the layers on each sequence's gathered rows in turn. A batched kernel is the GPU issue's
work. `pic+r` (which recomputes the rows that deviate most, from MLA's c_KV) is not available for V4,
nor is the triton backend, nor a compiled decode step.
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
from irminsul.model.base import Capabilities
from irminsul.model.deepseek_v4 import DeepseekV4ForCausalLM, load_deepseek_v4
from irminsul.model.settings import Settings


@dataclass(frozen=True)
class V4EngineConfig:
    """What the engine, the cache and the server read of a model's config."""

    num_hidden_layers: int
    row_width: int  # the widest layer's row; narrower layers use its first columns
    max_position_embeddings: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    model_type: str = "deepseek_v4"


@dataclass(frozen=True)
class V4Sequence:
    """One sequence of a step, on the model's device: its tokens are rows `rows` of the flat batch."""

    rows: slice
    q_positions: torch.Tensor  # [m] int64: the positions computed
    key_slots: torch.Tensor  # [T] int64: the pool slot of positions 0..T-1
    key_rope: torch.Tensor | None  # [T] RoPE position of each key; None: its own


@dataclass(frozen=True)
class V4Plan:
    """A step as V4's attention reads it: sequence by sequence."""

    seqs: tuple[V4Sequence, ...]


class V4Backend:
    """V4's attention (plain torch ops, model/deepseek_v4): its plan is the step's sequences, checked and on
    the device. The MLA backends (model/attention) do not apply to V4's compressed attention."""

    name = "v4-reference"

    def plan(self, seqs: list[SeqAttention], offsets: list[int], device) -> V4Plan:
        out = []
        for i, seq in enumerate(seqs):
            slots = np.asarray(seq.key_slots)
            missing = slots == EMPTY_SLOT
            missing[np.asarray(seq.q_positions)] = False
            if missing.any():  # (the engine fills every earlier position before computing a later one)
                raise RuntimeError(f"DeepSeek-V4: positions {np.flatnonzero(missing)[:8].tolist()} have no row")
            rope = None if seq.key_rope is None else torch.as_tensor(np.asarray(seq.key_rope), device=device)
            out.append(
                V4Sequence(
                    slice(offsets[i], offsets[i + 1]),
                    torch.as_tensor(np.asarray(seq.q_positions), device=device),
                    torch.as_tensor(slots, device=device),
                    rope,
                )
            )
        return V4Plan(tuple(out))


class V4Model(nn.Module):
    def __init__(
        self, model: DeepseekV4ForCausalLM, eos_token_ids: tuple[int, ...] = (), settings: Settings | None = None
    ):
        super().__init__()
        self.v4 = model
        # the switches, read once (model/settings.py): V4's reference path has none of its own; the
        # engine asks a model's for compile_decode
        self.settings = settings if settings is not None else Settings.from_env()
        cfg = model.config
        self.widths = [layer.self_attn.row_width for layer in model.model.layers]
        self.config = V4EngineConfig(
            cfg.num_hidden_layers, max(self.widths), cfg.max_position_embeddings, cfg.vocab_size, tuple(eos_token_ids)
        )
        self.attention = V4Backend()

    @classmethod
    def load(
        cls, path, dtype="float32", device: str = "cpu", pack: bool = True, settings: Settings | None = None
    ) -> V4Model:
        """(`pack` has nothing to do: V4's reference path keeps the checkpoint's layout.)"""
        raw = json.loads((Path(path) / "config.json").read_text())
        eos = raw.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(load_deepseek_v4(path, dtype=dtype, device=device), eos, settings)

    @property
    def device(self) -> torch.device:
        return self.v4.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.v4.lm_head.weight.dtype

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(backend=self.attention.name, fresh_rows=False)

    def set_attention_backend(self, name: str) -> None:
        if name not in ("cpu", "torch", "reference"):  # (the CPU default's names: V4 has one backend)
            raise ConfigError(f"attention_backend={name!r}: DeepSeek-V4 runs on its own reference attention only")

    @torch.inference_mode()
    def forward(self, batch) -> torch.Tensor:
        """A ForwardBatch whose plan is a V4Plan -> final hidden states [N, hidden]; every computed
        token's rows are written to the pool at batch.write_slots."""
        out = None
        for seq in batch.plan.seqs:
            rows = [batch.pool[layer, seq.key_slots, :w].clone() for layer, w in enumerate(self.widths)]
            hidden = self.v4.prefill_hidden(batch.token_ids[seq.rows], seq.q_positions, rows, seq.key_rope)
            for layer, (w, layer_rows) in enumerate(zip(self.widths, rows)):
                batch.pool[layer, batch.write_slots[seq.rows], :w] = layer_rows[seq.q_positions].to(batch.pool.dtype)
            if out is None:
                out = hidden.new_empty(batch.token_ids.shape[0], hidden.shape[-1])
            out[seq.rows] = hidden
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
