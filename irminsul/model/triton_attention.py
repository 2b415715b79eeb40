"""Attention over the latent pool in Triton: the `triton` backend (the torch backend's interface).

One kernel serves decode and prefill alike, in MLA's absorbed form (FlashMLA's scheme): a program
takes one query row (all heads) and one split of its keys, reads the keys' rows through the
sequence's slot table straight from the pool, rotates each key's un-rotated `k_r` at its RoPE
position on read (fp32, cos/sin from the model's own rotary table: YaRN and both pair layouts),
and keeps an online softmax over blocks of keys. The splits' partial results (running max, sum and
weighted latent) are then combined. The W_UK and W_UV products around it stay torch matmuls, as in
the torch backend.

So a content hit at another position costs nothing here either: the kernel reads shared rows
where they are and encodes them at the reading sequence's positions (`pic`), or at the positions
they were computed at (`naive`, the stale-`k_r` baseline).

On a machine without a GPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set
before triton is imported) on CPU tensors, slowly but exactly enough to test against the torch
backend; that is how CI tests them (tests/model/test_triton_attention.py).

Not yet here (issue 15): query tiling for long prefill spans (each query row reads its keys on its
own, correct but wasteful for prefill on a GPU), the expanded form for prefill, on-device sampling.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from irminsul.model.attention import EMPTY_SLOT, SeqAttention, TorchAttention
from irminsul.model.config import ModelConfig
from irminsul.model.rope import Rotary

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend needs none of this
    triton = None


def available() -> str | None:
    """None if the triton backend can run here, else why not."""
    if triton is None:
        return "the triton backend needs the `triton` package (pip install triton)"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return ("the triton backend needs a GPU, or TRITON_INTERPRET=1 in the environment before Python starts "
                "(Triton's CPU interpreter: slow, for tests)")
    return None


@dataclass
class TritonPlan:
    """A step's attention metadata: per query row, its sequence and the last key it sees."""

    q_seq: torch.Tensor  # [n] int32: the row of key_slots each query reads
    q_last: torch.Tensor  # [n] int32: its position (it attends keys 0..q_last)
    key_slots: torch.Tensor  # [B, T] int64, EMPTY_SLOT = no row
    key_pos: torch.Tensor | None  # [B, T] int32 RoPE position of each key; None: its own index
    max_pos: int  # the largest RoPE position any key is encoded at


class TritonAttention(TorchAttention):
    BLOCK_T = 32  # keys per inner step
    SPLIT = 256  # keys per split (FlashMLA's split over the key length)

    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        why = available()
        if why is not None:
            raise RuntimeError(why)
        super().__init__(cfg, rotary)

    def plan(self, seqs: list[SeqAttention], offsets: list[int], device) -> TritonPlan:
        n = sum(len(s.q_positions) for s in seqs)
        t = max(len(s.key_slots) for s in seqs)
        q_seq = np.zeros(n, np.int32)
        q_last = np.zeros(n, np.int32)
        slots = np.zeros((len(seqs), t), np.int64)
        pos = None if all(s.key_rope is None for s in seqs) else np.zeros((len(seqs), t), np.int32)
        for i, s in enumerate(seqs):
            rows = slice(offsets[i], offsets[i] + len(s.q_positions))
            q_seq[rows], q_last[rows] = i, s.q_positions
            slots[i, : len(s.key_slots)] = s.key_slots
            if pos is not None:
                pos[i, : len(s.key_slots)] = s.key_rope if s.key_rope is not None else np.arange(len(s.key_slots))
        max_pos = int(pos.max()) if pos is not None else t - 1
        as_t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        return TritonPlan(as_t(q_seq), as_t(q_last), as_t(slots), as_t(pos) if pos is not None else None, max_pos)

    def forward(self, attn, q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, plan: TritonPlan):
        cfg = self.cfg
        h, r = cfg.num_attention_heads, cfg.kv_lora_rank
        w = attn.kv_b_proj.weight.view(h, cfg.qk_nope_head_dim + cfg.v_head_dim, r)
        w_uk, w_uv = w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [n, H, r]: W_UK absorbed
        cos, sin = self.rotary.table(plan.max_pos + 1, pool.device)
        o_lat = mla_attention(q_lat, q_pe, pool, plan, cos, sin, cfg.softmax_scale,
                              self.rotary.config.cache_layout == "interleaved", self.BLOCK_T, self.SPLIT)
        return torch.bmm(o_lat.to(q_nope.dtype).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def mla_attention(q_lat, q_pe, pool, plan: TritonPlan, cos, sin, scale: float, interleaved: bool,
                  block_t: int = 32, split: int = 256) -> torch.Tensor:
    """Absorbed MLA attention of n query rows over the pool -> o_lat [n, H, r] float32.
    q_lat [n, H, r], q_pe [n, H, rope] (rotated, cache layout), pool [S, r + rope] of one layer."""
    n, h, r = q_lat.shape
    rope = q_pe.shape[-1]
    t = plan.key_slots.shape[1]
    splits = max(1, math.ceil(t / split))
    split_len = math.ceil(math.ceil(t / splits) / block_t) * block_t
    q_lat, q_pe = q_lat.contiguous(), q_pe.contiguous()
    block_h = max(16, triton.next_power_of_2(h))
    block_p = max(16, triton.next_power_of_2(rope // 2))
    block_r = max(16, triton.next_power_of_2(r))
    acc = torch.empty(n, splits, h, r, dtype=torch.float32, device=pool.device)
    mx = torch.empty(n, splits, h, dtype=torch.float32, device=pool.device)
    sm = torch.empty(n, splits, h, dtype=torch.float32, device=pool.device)
    key_pos = plan.key_pos if plan.key_pos is not None else plan.key_slots  # (unused when absent)
    _partial[(n, splits)](
        q_lat, q_pe, pool, plan.key_slots, key_pos, cos, sin, plan.q_seq, plan.q_last, acc, mx, sm,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), pool.stride(0),
        plan.key_slots.stride(0), key_pos.stride(0), cos.stride(0),
        h, r, rope // 2, split_len, scale,
        HAS_KEY_POS=plan.key_pos is not None, INTERLEAVED=interleaved,
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_P=block_p, BLOCK_T=block_t)
    if splits == 1:
        return acc[:, 0] / sm[:, 0, :, None]
    out = torch.empty(n, h, r, dtype=torch.float32, device=pool.device)
    _combine[(n,)](acc, mx, sm, out, splits, h, r, BLOCK_H=block_h, BLOCK_R=block_r)
    return out


if triton is not None:

    @triton.jit
    def _partial(q_lat, q_pe, pool, slots, key_pos, cos_tab, sin_tab, q_seq, q_last, acc_out, max_out, sum_out,
                 s_ql_n, s_ql_h, s_qp_n, s_qp_h, s_pool, s_slots, s_kpos, s_tab,
                 H, R, HALF, split_len, scale,
                 HAS_KEY_POS: tl.constexpr, INTERLEAVED: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr):
        """One query row x one split of its keys: online softmax over key blocks -> (acc, max, sum)."""
        row = tl.program_id(0)
        part = tl.program_id(1)
        n_parts = tl.num_programs(1)
        b = tl.load(q_seq + row)
        last = tl.load(q_last + row)
        offs_h = tl.arange(0, BLOCK_H)
        offs_r = tl.arange(0, BLOCK_R)
        offs_p = tl.arange(0, BLOCK_P)
        hm = offs_h < H
        rm = offs_r < R
        pm = offs_p < HALF
        if INTERLEAVED:  # pairs (2i, 2i + 1)
            ia, ib = 2 * offs_p, 2 * offs_p + 1
        else:  # halves (i, i + dim/2)
            ia, ib = offs_p, offs_p + HALF
        ql = tl.load(q_lat + row * s_ql_n + offs_h[:, None] * s_ql_h + offs_r[None, :],
                     mask=hm[:, None] & rm[None, :], other=0.0).to(tl.float32)
        qa = tl.load(q_pe + row * s_qp_n + offs_h[:, None] * s_qp_h + ia[None, :],
                     mask=hm[:, None] & pm[None, :], other=0.0).to(tl.float32)
        qb = tl.load(q_pe + row * s_qp_n + offs_h[:, None] * s_qp_h + ib[None, :],
                     mask=hm[:, None] & pm[None, :], other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        start = part * split_len
        end = tl.minimum(start + split_len, last + 1)
        for t0 in range(start, end, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            tm = offs_t < end
            slot = tl.load(slots + b * s_slots + offs_t, mask=tm, other=0)
            valid = tm & (slot != 0)
            base = pool + slot[:, None] * s_pool
            c = tl.load(base + offs_r[None, :], mask=valid[:, None] & rm[None, :], other=0.0).to(tl.float32)
            ka = tl.load(base + R + ia[None, :], mask=valid[:, None] & pm[None, :], other=0.0).to(tl.float32)
            kb = tl.load(base + R + ib[None, :], mask=valid[:, None] & pm[None, :], other=0.0).to(tl.float32)
            if HAS_KEY_POS:
                pos = tl.load(key_pos + b * s_kpos + offs_t, mask=tm, other=0)
            else:
                pos = offs_t
            cs = tl.load(cos_tab + pos[:, None] * s_tab + offs_p[None, :], mask=valid[:, None] & pm[None, :], other=0.0)
            sn = tl.load(sin_tab + pos[:, None] * s_tab + offs_p[None, :], mask=valid[:, None] & pm[None, :], other=0.0)
            ra = ka * cs - kb * sn  # RoPE on read, at the key's position
            rb = kb * cs + ka * sn
            s = tl.dot(ql, tl.trans(c), input_precision="ieee")
            s += tl.dot(qa, tl.trans(ra), input_precision="ieee")
            s += tl.dot(qb, tl.trans(rb), input_precision="ieee")
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with no key yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
            m_i = m_new
        out = (row * n_parts + part) * H + offs_h
        tl.store(acc_out + out[:, None] * R + offs_r[None, :], acc, mask=hm[:, None] & rm[None, :])
        tl.store(max_out + out, m_i, mask=hm)
        tl.store(sum_out + out, l_i, mask=hm)

    @triton.jit
    def _combine(acc_in, max_in, sum_in, out, n_parts, H, R, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
        """The splits of one query row -> its softmax-weighted latent [H, r]."""
        row = tl.program_id(0)
        offs_h = tl.arange(0, BLOCK_H)
        offs_r = tl.arange(0, BLOCK_R)
        hm = offs_h < H
        rm = offs_r < R
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        for k in range(0, n_parts):
            m = tl.maximum(m, tl.load(max_in + (row * n_parts + k) * H + offs_h, mask=hm, other=float("-inf")))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.where(hm, 0.0, 1.0)  # (padding heads: 0 / 1, not 0 / 0)
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        for k in range(0, n_parts):
            at = (row * n_parts + k) * H + offs_h
            w = tl.exp(tl.load(max_in + at, mask=hm, other=float("-inf")) - m_safe)
            total += w * tl.load(sum_in + at, mask=hm, other=0.0)
            acc += w[:, None] * tl.load(acc_in + at[:, None] * R + offs_r[None, :], mask=hm[:, None] & rm[None, :],
                                        other=0.0)
        tl.store(out + (row * H + offs_h)[:, None] * R + offs_r[None, :], acc / total[:, None],
                 mask=hm[:, None] & rm[None, :])
