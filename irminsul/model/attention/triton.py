"""Attention over the latent pool in Triton: the `triton` backend.

One kernel serves decode and prefill alike, in MLA's absorbed form (FlashMLA's scheme): a program
takes a tile of query rows of one sequence (one row for decode, 64 / H rows for prefill spans), all
heads, and one split of its keys, reads the keys' rows through the
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

DeepSeek-V3.2's sparse attention enters as a per-query selection mask: the indexer's scores and
top-k are computed in torch (`_selection`) and the kernel ANDs the mask into its causal one. Not yet
here: a fused indexer kernel that hands the attention kernel a key list per query
(FlashMLA's sparse decode), the expanded form for long prefill spans, tile sizes tuned on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from irminsul.errors import RequestError
from irminsul.model.attention.base import AttentionBackend, SeqAttention, absorb_output, absorb_query, dsa_selection
from irminsul.model.config import ModelConfig
from irminsul.model.rope import Rotary, encode_half
from irminsul.model.settings import Settings, settings

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend needs none of this
    triton = None


# Triton's interpreter computes a bf16 tl.dot wrongly (NumPy has no bf16): there, the kernel takes its
# fp32 path for every pool dtype, and the bf16 tensor-core path is exercised on a GPU only. (Read once,
# when this module is imported, as Triton reads it when it is.)
INTERPRETED = settings.triton_interpret


def available() -> str | None:
    """None if the triton backend can run here, else why not."""
    if triton is None:
        return "the triton backend needs the `triton` package (pip install triton)"
    if not torch.cuda.is_available() and not INTERPRETED:
        return (
            "the triton backend needs a GPU, or TRITON_INTERPRET=1 in the environment before Python starts "
            "(Triton's CPU interpreter: slow, for tests)"
        )
    return None


@dataclass
class Tiles:
    """Query tiles of one launch: up to `block_m` consecutive query rows of one sequence each."""

    seq: torch.Tensor  # [tiles] int32: the row of key_slots the tile's queries read
    row0: torch.Tensor  # [tiles] int32: its first query row in the flat batch
    rows: torch.Tensor  # [tiles] int32: how many query rows it has (<= block_m)
    end: torch.Tensor  # [tiles] int32: 1 + the last position any of its queries sees
    block_m: int
    max_end: int


@dataclass
class TritonPlan:
    """A step's attention metadata: per query row the last key it sees, and the query tiles: one
    row each for decode, blocks of a sequence's consecutive rows for prefill spans (their keys are
    read once per tile, not once per row)."""

    q_last: torch.Tensor  # [n] int32: each query's position (it attends keys 0..q_last)
    q_seq: torch.Tensor  # [n] int64: the row of key_slots each query reads
    key_slots: torch.Tensor  # [B, T] int64, EMPTY_SLOT = no row
    key_pos: torch.Tensor | None  # [B, T] int32 RoPE position of each key; None: its own index
    max_pos: int  # the largest RoPE position any key is encoded at
    tiles: list[Tiles]
    # splits of the key length per tile: None, from the longest tile (SPLIT keys each); a fixed count
    # for a captured decode step (model/graphs.py), whose launch grid cannot follow the lengths
    splits: int | None = None


class TritonAttention(AttentionBackend):
    name = "triton"
    BLOCK_T = 32  # keys per inner step
    SPLIT = 256  # keys per split (FlashMLA's split over the key length)

    def __init__(self, cfg: ModelConfig, rotary: Rotary, settings: Settings | None = None):
        why = available()
        if why is not None:
            raise RequestError(why)
        super().__init__(cfg, rotary, settings)

    def plan(self, seqs: list[SeqAttention], offsets: list[int], device) -> TritonPlan:
        n = sum(len(s.q_positions) for s in seqs)
        t = max(len(s.key_slots) for s in seqs)
        q_last = np.zeros(n, np.int32)
        q_seq = np.zeros(n, np.int64)
        slots = np.zeros((len(seqs), t), np.int64)
        pos = None if all(s.key_rope is None for s in seqs) else np.zeros((len(seqs), t), np.int32)
        decode, prefill = [], []  # tiles: (seq, first row, rows, end)
        block_m = prefill_block_m(self.cfg.num_attention_heads)
        for i, s in enumerate(seqs):
            m = len(s.q_positions)
            q_last[offsets[i] : offsets[i] + m] = s.q_positions
            q_seq[offsets[i] : offsets[i] + m] = i
            slots[i, : len(s.key_slots)] = s.key_slots
            if pos is not None:
                pos[i, : len(s.key_slots)] = s.key_rope if s.key_rope is not None else np.arange(len(s.key_slots))
            if m == 1:
                decode.append((i, offsets[i], 1, int(s.q_positions[0]) + 1))
            for a in range(0, m if m > 1 else 0, block_m):
                k = min(block_m, m - a)
                prefill.append((i, offsets[i] + a, k, int(s.q_positions[a + k - 1]) + 1))
        max_pos = int(pos.max()) if pos is not None else t - 1
        as_t = lambda a: torch.from_numpy(np.asarray(a, np.int32)).to(device)  # noqa: E731
        tiles = [
            Tiles(*(as_t(col) for col in zip(*group)), block, max(e for *_, e in group))
            for group, block in ((decode, 1), (prefill, block_m))
            if group
        ]
        return TritonPlan(
            as_t(q_last),
            torch.from_numpy(q_seq).to(device),
            torch.from_numpy(slots).to(device),
            as_t(pos) if pos is not None else None,
            max_pos,
            tiles,
        )

    def forward(self, attn, q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, plan: TritonPlan, index=None):
        cfg = self.cfg
        w_uk, w_uv = self.absorbed_weights(attn)
        q_lat = absorb_query(q_nope, w_uk, per_head=self.settings.gemv)  # [n, H, r]
        cos, sin = self.rotary.table(plan.max_pos + 1, pool.device)
        selected = None if index is None else self._selection(index, pool, plan, cos, sin)
        o_lat = mla_attention(
            q_lat,
            q_pe,
            pool,
            plan,
            cos,
            sin,
            cfg.softmax_scale,
            self.rotary.config.cache_layout == "interleaved",
            self.BLOCK_T,
            self.SPLIT,
            selected,
        )
        return absorb_output(o_lat.to(q_nope.dtype), w_uv, per_head=self.settings.gemv)

    def _selection(self, index, pool, plan: TritonPlan, cos, sin) -> torch.Tensor:
        """DeepSeek-V3.2's DSA in torch: each query's index_topk best keys by its indexer scores ->
        uint8 [n, T] (1 = attend), which the kernel ANDs into its causal mask. (A reference path: a
        fused indexer kernel that hands the kernel a key list per query is the GPU version.)"""
        q, w = index  # [n, heads, d] scaled, [n, heads]
        b, t = plan.key_slots.shape
        rows = pool.index_select(0, plan.key_slots.view(-1)).view(b, t, -1)[..., self.cfg.latent_width :]
        pos = (plan.key_pos if plan.key_pos is not None else torch.arange(t, device=pool.device)).long()
        keys = encode_half(rows.float(), cos[pos], sin[pos])  # [B, T, d], rotary part at each key's position
        visible = (torch.arange(t, device=pool.device)[None, :] <= plan.q_last[:, None].long()) & (
            plan.key_slots[plan.q_seq] != 0
        )
        return dsa_selection(q, w, keys[plan.q_seq], visible, self.cfg.index_topk).to(torch.uint8)


def prefill_block_m(heads: int) -> int:
    """Query rows per prefill tile: the tile is (rows x heads) queries against one block of keys;
    64 of them fill a tensor-core tile, and at least 16 are needed for tl.dot."""
    return max(1, 64 // triton.next_power_of_2(heads)) if triton is not None else 1


def mla_attention(
    q_lat,
    q_pe,
    pool,
    plan: TritonPlan,
    cos,
    sin,
    scale: float,
    interleaved: bool,
    block_t: int = 32,
    split: int = 256,
    selected: torch.Tensor | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of n query rows over the pool -> o_lat [n, H, r] float32.
    q_lat [n, H, r], q_pe [n, H, rope] (rotated, cache layout), pool [S, r + rope] of one layer.
    One launch per tile kind (decode rows, prefill blocks), each split over the key length.
    block_t keys per inner step; num_warps None: 8 for large tiles, else 4 (neither tuned on a GPU
    yet: `python benchmarks/gpu_tiles.py`)."""
    n, h, r = q_lat.shape
    rope = q_pe.shape[-1]
    q_lat, q_pe = q_lat.contiguous(), q_pe.contiguous()
    block_p = max(16, triton.next_power_of_2(rope // 2))
    block_r = max(16, triton.next_power_of_2(r))
    splits = plan.splits or max(1, math.ceil(max(t.max_end for t in plan.tiles) / split))
    # every row's partial results, one slot per split (a row in no tile of a split keeps -inf / 0)
    acc = torch.zeros(n, splits, h, r, dtype=torch.float32, device=pool.device)
    mx = torch.full((n, splits, h), float("-inf"), dtype=torch.float32, device=pool.device)
    sm = torch.zeros(n, splits, h, dtype=torch.float32, device=pool.device)
    key_pos = plan.key_pos if plan.key_pos is not None else plan.key_slots  # (unused when absent)
    sel = selected if selected is not None else plan.q_last  # (unused when absent)
    for tiles in plan.tiles:
        block_h = triton.next_power_of_2(h)
        if tiles.block_m * block_h < 16:
            block_h = 16 // tiles.block_m  # tl.dot needs 16 rows
        _partial[(len(tiles.seq), splits)](
            q_lat,
            q_pe,
            pool,
            plan.key_slots,
            key_pos,
            cos,
            sin,
            tiles.seq,
            tiles.row0,
            tiles.rows,
            tiles.end,
            plan.q_last,
            sel,
            acc,
            mx,
            sm,
            q_lat.stride(0),
            q_lat.stride(1),
            q_pe.stride(0),
            q_pe.stride(1),
            pool.stride(0),
            plan.key_slots.stride(0),
            key_pos.stride(0),
            cos.stride(0),
            sel.stride(0),
            h,
            r,
            rope // 2,
            splits,
            scale,
            HAS_KEY_POS=plan.key_pos is not None,
            HAS_SEL=selected is not None,
            INTERLEAVED=interleaved,
            LOW=pool.dtype in (torch.bfloat16, torch.float16) and not INTERPRETED,
            BLOCK_M=tiles.block_m,
            BLOCK_H=block_h,
            BLOCK_R=block_r,
            BLOCK_P=block_p,
            BLOCK_T=block_t,
            num_warps=num_warps or (8 if tiles.block_m * block_h * block_r >= 16384 else 4),
        )
    if splits == 1:  # (a row that saw no key, a captured step's padding, gets 0, not 0 / 0)
        return acc[:, 0] / torch.where(sm[:, 0] > 0, sm[:, 0], 1.0)[..., None]
    out = torch.empty(n, h, r, dtype=torch.float32, device=pool.device)
    block_h = triton.next_power_of_2(h)
    _combine[(n,)](acc, mx, sm, out, splits, h, r, BLOCK_H=block_h, BLOCK_R=block_r)
    return out


if triton is not None:

    @triton.jit
    def _partial(
        q_lat,
        q_pe,
        pool,
        slots,
        key_pos,
        cos_tab,
        sin_tab,
        t_seq,
        t_row0,
        t_rows,
        t_end,
        q_last,
        sel,
        acc_out,
        max_out,
        sum_out,
        s_ql_n,
        s_ql_h,
        s_qp_n,
        s_qp_h,
        s_pool,
        s_slots,
        s_kpos,
        s_tab,
        s_sel,
        H,
        R,
        HALF,
        n_parts,
        scale,
        HAS_KEY_POS: tl.constexpr,
        HAS_SEL: tl.constexpr,
        INTERLEAVED: tl.constexpr,
        LOW: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        """One tile (BLOCK_M query rows of one sequence, all heads, as BLOCK_M * BLOCK_H rows of one
        product) x one split of the keys: online softmax over key blocks -> (acc, max, sum) per row."""
        tile = tl.program_id(0)
        part = tl.program_id(1)
        b = tl.load(t_seq + tile)
        row0 = tl.load(t_row0 + tile)
        n_rows = tl.load(t_rows + tile)
        offs_q = tl.arange(0, BLOCK_M * BLOCK_H)  # query x head, head fastest
        qm = offs_q // BLOCK_H
        qh = offs_q % BLOCK_H
        row = row0 + qm
        live = (qm < n_rows) & (qh < H)
        last = tl.load(q_last + row, mask=live, other=-1)
        offs_r = tl.arange(0, BLOCK_R)
        offs_p = tl.arange(0, BLOCK_P)
        rm = offs_r < R
        pm = offs_p < HALF
        if INTERLEAVED:  # pairs (2i, 2i + 1)
            ia, ib = 2 * offs_p, 2 * offs_p + 1
        else:  # halves (i, i + dim/2)
            ia, ib = offs_p, offs_p + HALF
        ql = tl.load(
            q_lat + row[:, None] * s_ql_n + qh[:, None] * s_ql_h + offs_r[None, :],
            mask=live[:, None] & rm[None, :],
            other=0.0,
        ).to(tl.float32)
        qa = tl.load(
            q_pe + row[:, None] * s_qp_n + qh[:, None] * s_qp_h + ia[None, :],
            mask=live[:, None] & pm[None, :],
            other=0.0,
        ).to(tl.float32)
        qb = tl.load(
            q_pe + row[:, None] * s_qp_n + qh[:, None] * s_qp_h + ib[None, :],
            mask=live[:, None] & pm[None, :],
            other=0.0,
        ).to(tl.float32)
        m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_R], tl.float32)
        t_end_tile = tl.load(t_end + tile)
        # the tile's keys in n_parts runs of whole key blocks (computed here, so a launch grid fixed
        # at capture serves any lengths; splits past a short tile's keys find none and store -inf / 0)
        split_len = tl.cdiv(tl.cdiv(t_end_tile, n_parts), BLOCK_T) * BLOCK_T
        start = part * split_len
        end = tl.minimum(start + split_len, t_end_tile)
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
            if LOW:  # a bf16 / fp16 pool: tensor-core products of the stored precision, fp32 sums
                s = tl.dot(ql.to(pool.dtype.element_ty), tl.trans(c.to(pool.dtype.element_ty)))
            else:  # fp32: exact products (no tf32), as the torch backend computes them
                s = tl.dot(ql, tl.trans(c), input_precision="ieee")
            s += tl.dot(qa, tl.trans(ra), input_precision="ieee")
            s += tl.dot(qb, tl.trans(rb), input_precision="ieee")
            seen = valid[None, :] & (offs_t[None, :] <= last[:, None])  # causal, per query row
            if HAS_SEL:  # V3.2: only the keys the indexer picked for this query
                pick = tl.load(sel + row[:, None] * s_sel + offs_t[None, :], mask=live[:, None] & tm[None, :], other=0)
                seen = seen & (pick != 0)
            s = tl.where(seen, s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if LOW:
                acc = acc * alpha[:, None] + tl.dot(p.to(pool.dtype.element_ty), c.to(pool.dtype.element_ty))
            else:
                acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
            m_i = m_new
        out = (row * n_parts + part) * H + qh
        tl.store(acc_out + out[:, None] * R + offs_r[None, :], acc, mask=live[:, None] & rm[None, :])
        tl.store(max_out + out, m_i, mask=live)
        tl.store(sum_out + out, l_i, mask=live)

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
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        for k in range(0, n_parts):
            at = (row * n_parts + k) * H + offs_h
            w = tl.exp(tl.load(max_in + at, mask=hm, other=float("-inf")) - m_safe)
            total += w * tl.load(sum_in + at, mask=hm, other=0.0)
            acc += w[:, None] * tl.load(
                acc_in + at[:, None] * R + offs_r[None, :], mask=hm[:, None] & rm[None, :], other=0.0
            )
        total = tl.where(total > 0, total, 1.0)  # (padding heads, and rows that saw no key: 0, not 0 / 0)
        tl.store(
            out + (row * H + offs_h)[:, None] * R + offs_r[None, :],
            acc / total[:, None],
            mask=hm[:, None] & rm[None, :],
        )
