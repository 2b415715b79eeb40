"""What every attention backend shares: the step's per-sequence description, the backend interface,
and the parts of absorbed MLA that do not depend on the kernel.

A backend is called twice per forward pass: `plan` once, with every sequence's query positions and
slot table, to build the metadata its kernels read (its own type: the reference and cpu backends' padded groups,
the triton backend's tiles); `forward` once per layer, with that plan. Both backends compute the
absorbed form around their attention core: q_nope · W_UK before it, o_lat · W_UV after it
(DeepSeek-V2, arXiv 2405.04434, section 2.1.2), with W_UK and W_UV read out of `kv_b_proj`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from irminsul.model import gemv
from irminsul.model.config import ModelConfig
from irminsul.model.rope import Rotary
from irminsul.model.settings import Settings

EMPTY_SLOT = 0  # pool slot 0 holds no row: padding and not-yet-filled positions point here
PADDING_SLACK = 1.5  # a group's padded work (B x M x T) stays within this factor of its real work


@dataclass(frozen=True)
class SeqAttention:
    """What one sequence contributes to a step's attention (built by the caller)."""

    q_positions: np.ndarray  # [m] int64, increasing: the positions computed this step
    key_slots: np.ndarray  # [T] int64: pool slot of positions 0..T-1 (EMPTY_SLOT: no row), T > max(q)
    key_rope: np.ndarray | None = None  # [T] RoPE position of each key; None: its own position


def consecutive(slots: np.ndarray) -> bool:
    """Whether the slots are one increasing run s, s + 1, ... (rows that can be read in place)."""
    return len(slots) < 2 or bool((np.diff(slots) == 1).all())


class AttentionBackend(ABC):
    """Attention of a step's queries over the latent pool, `[c_KV | k_r]` rows read through slot tables."""

    name: str  # "cpu", "reference" or "triton": what `set_attention_backend` takes and a runner asks for

    def __init__(self, cfg: ModelConfig, rotary: Rotary, settings: Settings | None = None):
        """settings: the switches it runs by (its model's), else the environment's, read now."""
        self.cfg, self.rotary = cfg, rotary
        self.settings = settings if settings is not None else Settings.from_env()

    @abstractmethod
    def plan(self, seqs: list[SeqAttention], offsets: list[int], device):
        """The step's attention metadata, once per forward pass. Sequence i's queries are rows
        offsets[i]:offsets[i+1] of the flat batch."""

    @abstractmethod
    def forward(
        self, attn, q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, plan, index=None
    ) -> torch.Tensor:
        """q_nope [n, H, nope], q_pe [n, H, rope] (rotated) of the step's queries, pool [S, W] of this
        layer, `plan` from `plan` -> attention output [n, H, v_head_dim] (before o_proj). `index`:
        V3.2's indexer queries and head weights ([n, heads, d], [n, heads]), else None."""

    def absorbed_weights(self, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, r], W_UV [H, v, r]): the two halves of the layer's kv_b_proj (views of it, or
        the contiguous copies `MLAttention.pack` keeps of them for bf16)."""
        kept = getattr(attn, "absorbed", None)
        if kept is not None and (
            torch.compiler.is_compiling() or attn.absorbed_from == attn.kv_b_proj.weight.data_ptr()
        ):
            return kept
        cfg = self.cfg
        w = attn.kv_b_proj.weight.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def absorbed_widen(self, attn) -> tuple[int, int]:
        """From how many rows on the W_UK and the W_UV products run in float32 (0: never): what
        `MLAttention.pack` took from the kernel choices for a bf16 model (`kernel_choice.Choice.widen`)."""
        return getattr(attn, "absorbed_widen", (0, 0))


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor, widen_rows: int = 0, per_head: bool = False) -> torch.Tensor:
    """q_nope [n, H, nope] -> q_lat [n, H, r]: W_UK absorbed into the query; from `widen_rows` rows on
    (0: never) in float32 (`AttentionBackend.absorbed_widen`); `per_head`: through the native per-head
    products where they run (`_heads`; a backend passes its settings' gemv switch)."""
    if per_head and (y := _heads(q_nope, w_uk.transpose(1, 2))) is not None:
        return y
    if 0 < widen_rows <= q_nope.shape[0]:
        return torch.bmm(q_nope.transpose(0, 1).float(), w_uk.float()).transpose(0, 1).to(q_nope.dtype)
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def absorb_output(o_lat: torch.Tensor, w_uv: torch.Tensor, widen_rows: int = 0, per_head: bool = False) -> torch.Tensor:
    """o_lat [n, H, r] (softmax-weighted latents) -> [n, H, v]: W_UV absorbed into the output; from
    `widen_rows` rows on (0: never) in float32; `per_head` as `absorb_query`'s."""
    if per_head and (y := _heads(o_lat, w_uv)) is not None:
        return y
    if 0 < widen_rows <= o_lat.shape[0]:
        return torch.bmm(o_lat.transpose(0, 1).float(), w_uv.float().transpose(1, 2)).transpose(0, 1).to(o_lat.dtype)
    return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def _heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [n, H, in] times w [H, out, in] through the native per-head products (`gemv.heads`) for a
    decode step's few rows of a bf16 model on a CPU, else None (torch's bmm). bf16 bmm reads a cold
    W_UK well below the memory's speed in a decode step, where the kernel streams it
    (docs/benchmarks.md, real shapes)."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    return gemv.heads(x, w)


def dsa_selection(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, topk: int):
    """DeepSeek-V3.2's sparse attention: the visible keys [..., T] (bool) narrowed to the `topk` that
    score best under sum_h w_h * relu(q_h . k): q [..., heads, d] (scaled), w [..., heads], keys
    [..., T, d] (rotary part encoded), the leading dims broadcast."""
    scores = torch.einsum("...hd,...td->...ht", q, keys).relu()
    scores = torch.einsum("...h,...ht->...t", w, scores).masked_fill(~visible, float("-inf"))
    top = scores.topk(min(topk, scores.shape[-1]), dim=-1).indices
    return visible & torch.zeros_like(visible).scatter_(-1, top, True)
