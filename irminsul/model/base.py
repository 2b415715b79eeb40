"""The interface a model family presents to the engine's model runner, and what it declares it can do.

A runner holds a `Model` and calls only this:

- `config`: `num_hidden_layers`, `row_width` (one pool row per token and layer), `max_position_embeddings`,
  `vocab_size`, `eos_token_ids`, `model_type`: what the pool, the cache and the server size themselves by;
- `device`, `dtype`: where the pool lives and what it stores;
- `capabilities`: the family's optional parts (`Capabilities`), so a runner never probes the model;
- `attention.plan(seqs, offsets, device)`: once per step, the attention backend's plan (its own type)
  for the step's sequences (`SeqAttention`; sequence i's tokens are rows offsets[i]:offsets[i+1]);
- `model(batch)`: a `ForwardBatch` (tokens, positions, the pool, the slots the computed rows go to, that
  plan) -> final hidden states [N, hidden]; every computed token's rows are written to the pool;
- `logits(hidden)`: [N, hidden] -> float32 logits [N, vocab];
- `fresh_rows(batch, layer)`: only where `capabilities.fresh_rows` (a family without it has no such
  method), the rows [N, row_width] pool layer `layer`
  would store for the batch in its current context (pic+r's check of reused rows); the pool is untouched
  beyond the batch's own write slots of the layers before `layer`;
- `set_attention_backend(name)`: one of `attention.BACKENDS` (a `RequestError` / `ConfigError` where the
  family has no such backend).

Families register their class by `model_type` in registry.py. Compiled and captured decode steps
(`CompiledStep`, `CapturedStep`) are the runner's to build (model/compiled.py, model/graphs.py): each
says which models it covers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Capabilities:
    """What a family offers beyond the forward pass, as the runner may ask."""

    backend: str  # the attention backend the model runs now: its `name` ("cpu", "reference", "triton", ...)
    fresh_rows: bool  # `Model.fresh_rows` (pic+r's recompute check)
    indexer: bool = False  # its pool rows carry DSA's indexer key beside the latent (DeepSeek-V3.2)


@runtime_checkable
class CompiledStep(Protocol):
    """A compiled decode step on a CPU (`model/compiled.py`): one sequence over consecutive slots, or up
    to `max_batch` sequences through their slot tables; `pays` says which of the two ("one", "batch")
    the engine takes compiled (measured on the machine, or required)."""

    max_batch: int
    pays: dict[str, bool]

    def __call__(
        self, token: torch.Tensor, pos: torch.Tensor, pool: torch.Tensor, base: int, n_keys: int
    ) -> torch.Tensor: ...

    def batch(
        self, tokens: torch.Tensor, pos: torch.Tensor, key_slots: torch.Tensor, pool: torch.Tensor, write: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class CapturedStep(Protocol):
    """Decode steps captured as CUDA graphs over one pool (`model/graphs.py`)."""

    def fits(self, n: int, longest: int) -> bool: ...

    def __call__(self, tokens, lengths, slots) -> torch.Tensor: ...


@runtime_checkable
class Model(Protocol):
    config: object
    attention: object  # the backend: `plan(seqs, offsets, device)` and `name`

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def capabilities(self) -> Capabilities: ...

    def __call__(self, batch) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def set_attention_backend(self, name: str) -> None: ...
