"""Attention over the latent pool, batched across sequences: the reference backend (plain torch ops,
any device torch runs on; cpu.py is the same backend with native kernels where they run).

The pool holds one row per token and layer, `[c_KV | k_r]`, with `k_r` stored *un-rotated* (in the
cache's pair layout). A row therefore has no position in it at all, and a content hit at another
position shares it as it is: no copy, no rotation at admission. RoPE is applied when attention
reads the keys, in fp32 with the model's own rotary class (YaRN, both layouts), at each key's
RoPE position: its position in the sequence (`pic`, and every computed row), or, for the paper's
`naive` baseline, the position it was computed at (stale `k_r`).

A step's sequences fall into a few groups, each one padded batch and one call per layer: decode
(one query per sequence) in the absorbed form, and prefill spans (several queries per sequence)
in the absorbed or the expanded form, whichever costs fewer multiply-adds (`expand_is_cheaper`,
the split SGLang and vLLM make for MLA). Sequences of very different lengths go to different
groups, so that padding never more than `PADDING_SLACK`-folds a group's work (a 1,500-row
sequence beside thirty 200-row ones would otherwise make each of them read 1,500 rows). Keys are every position
0..T-1 of a sequence, read through its slot table; slot 0 is "no row" (padding, or a gap in a
sparse prefill) and is masked out. A query at position p attends to every row at a position <= p.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from irminsul.model.attention.base import (
    EMPTY_SLOT,
    PADDING_SLACK,
    AttentionBackend,
    SeqAttention,
    absorb_output,
    absorb_query,
    consecutive,
    dsa_selection,
)
from irminsul.model.config import ModelConfig
from irminsul.model.rope import encode_half, encode_pairwise


@dataclass
class AttentionGroup:
    """One padded batch of sequences: B sequences, M query rows and T key rows each."""

    token_index: torch.Tensor  # [n] rows of the flat batch that are this group's queries
    grid_index: torch.Tensor  # [n] their places in the padded [B * M] query grid
    key_slots: torch.Tensor  # [B, T]
    key_cos: torch.Tensor  # [B or 1, T, rope/2] float32
    key_sin: torch.Tensor
    query_pos: torch.Tensor  # [B, M] each query row's position (a padded row: the last key's)
    expanded: bool
    # every sequence computes positions 0..m-1 with no row before them (a prompt prefilled from
    # scratch): the mask is plain causal, which SDPA runs about twice as fast as an explicit mask
    causal: bool = False
    # every query sees every key (decode rows, no holes, no padding): the mask need not be applied
    dense: bool = False
    # one sequence whose keys are the consecutive slots run, run + 1, ... (a sequence decoding
    # alone, its rows allocated in order): attention reads them in place, no gather
    run: int | None = None
    # the step's only group: its queries are every row of the flat batch, in order (token_index is
    # 0..n-1), so its inputs need no gather and its output no scatter
    whole: bool = False
    # every sequence's last query is at its last key (decoding, or a prompt's last span): with one
    # query per sequence, its mask is then "every non-empty slot" (cpu.py's native decode)
    at_end: bool = False
    # the mask where it is not built from the slots and positions (V3.2's indexer narrows it)
    explicit_mask: torch.Tensor | None = None
    # [B] each sequence's query rows (the rest of its M are padding)
    query_len: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.key_slots.shape[0], self.query_pos.shape[1], self.key_slots.shape[1]  # (B, M, T)

    @property
    def mask(self) -> torch.Tensor:
        """[B, M, T] bool, True = attend: a key with a row at a position <= the query's. Built when
        first asked for (a causal prefill and a native decode group never need it)."""
        if self.explicit_mask is None:
            t = self.key_slots.shape[1]
            self.explicit_mask = (self.key_slots != EMPTY_SLOT)[:, None, :] & (
                torch.arange(t, device=self.key_slots.device)[None, None, :] <= self.query_pos[:, :, None]
            )
        return self.explicit_mask


def expand_is_cheaper(cfg: ModelConfig, m: int, length: int, padded: bool = False) -> bool:
    """Absorbed attention costs ~m·L·H·(2r + rope) multiply-adds; expanding the latent into
    per-head keys and values costs L·H·r·(nope + v) once, then m·L·H·(nope + rope + v), with v
    q·k and v both counted at the wider of the two where the expanded kernel pads them to it
    (`padded`: `ReferenceAttention.EQUAL_WIDTHS` on a CPU). Prefill (large m) expands, decode (m = 1)
    absorbs. At MLA's 192 / 128 widths (r 512) this expands from m = 187 (padded; 171 not); measured
    on one thread, bf16 and fp32, the two cross between m = 128 and 256 for 2k-8k keys
    (docs/performance.md, Prefill attention)."""
    wide = max(cfg.qk_head_dim, cfg.v_head_dim)
    qk, v = (wide, wide) if padded else (cfg.qk_head_dim, cfg.v_head_dim)
    absorbed = m * length * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    expanded = length * cfg.kv_lora_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim) + m * length * (qk + v)
    return expanded < absorbed


class ReferenceAttention(AttentionBackend):
    """The reference backend: plain torch ops, any device torch runs on."""

    name = "reference"
    # Expanded prefill on a CPU pads the narrower of the q·k and v widths with zeros (exact: zero
    # v columns give zero output columns, dropped; zero q·k columns add nothing to a score), because
    # SDPA's CPU flash kernel wants the two equal: MLA's are 192 and 128, and unequal widths fall to
    # the math kernel, which materialises every [M, T] score matrix of every head (docs/performance.md,
    # Prefill attention). The flash kernel streams keys in blocks (memory linear in T, explicit masks
    # included). False: the unpadded call (for benchmarks/bench_long_prefill.py).
    EQUAL_WIDTHS = True

    # -- once per forward pass -----------------------------------------------------------

    def plan(self, seqs: list[SeqAttention], offsets: list[int], device) -> list[AttentionGroup]:
        """Group the step's sequences (decode / prefill) and build each group's padded metadata."""
        decode = [i for i, s in enumerate(seqs) if len(s.q_positions) == 1]
        prefill = [i for i, s in enumerate(seqs) if len(s.q_positions) > 1]
        groups = [
            self._group([seqs[i] for i in ids], [offsets[i] for i in ids], device)
            for kind in (decode, prefill)
            for ids in _buckets(kind, seqs)
        ]
        if len(groups) == 1:  # (its sequences are all of them, in order: token_index is 0..n-1)
            groups[0].whole = True
        return groups

    def _group(self, seqs: list[SeqAttention], starts: list[int], device) -> AttentionGroup:
        b, m = len(seqs), max(len(s.q_positions) for s in seqs)
        t = max(len(s.key_slots) for s in seqs)
        slots = np.zeros((b, t), np.int64)
        qpos = np.zeros((b, m), np.int64)
        token_index, grid_index = [], []
        rope = None if all(s.key_rope is None for s in seqs) else np.zeros((b, t), np.int64)
        causal = m == t
        for i, s in enumerate(seqs):
            n, k = len(s.q_positions), len(s.key_slots)
            causal = causal and n == k and int(s.q_positions[0]) == 0 and int(s.q_positions[-1]) == n - 1
            slots[i, :k] = s.key_slots
            qpos[i, :n] = s.q_positions
            qpos[i, n:] = k - 1  # padded query rows see every key (never a fully masked row)
            token_index.append(np.arange(starts[i], starts[i] + n))
            grid_index.append(np.arange(i * m, i * m + n))
            if rope is not None:
                rope[i, :k] = s.key_rope if s.key_rope is not None else np.arange(k)
        dense = bool((qpos == t - 1).all() and (slots != EMPTY_SLOT).all())
        at_end = all(int(s.q_positions[-1]) == len(s.key_slots) - 1 for s in seqs)
        run = int(slots[0, 0]) if b == 1 and dense and consecutive(slots[0]) else None
        key_slots = torch.from_numpy(slots).to(device)
        if rope is None:  # every key at its own position: one table slice serves the whole group
            cos, sin = self.rotary.table(t, device)
            cos, sin = cos[None, :t], sin[None, :t]
        else:
            cos, sin = self.rotary.cos_sin(torch.from_numpy(rope).reshape(-1).to(device))
            cos, sin = cos.view(b, t, -1), sin.view(b, t, -1)
        return AttentionGroup(
            torch.from_numpy(np.concatenate(token_index)).to(device),
            torch.from_numpy(np.concatenate(grid_index)).to(device),
            key_slots,
            cos,
            sin,
            torch.from_numpy(qpos).to(device),
            m > 1 and expand_is_cheaper(self.cfg, m, t, self._pads(device)),
            causal,
            dense,
            run,
            at_end=at_end,
            query_len=torch.tensor([len(s.q_positions) for s in seqs], dtype=torch.int64),
        )

    def _pads(self, device) -> bool:
        """Whether expanded attention on `device` widens the narrower of q·k and v (`EQUAL_WIDTHS`)."""
        return self.EQUAL_WIDTHS and torch.device(device).type == "cpu"

    # -- once per layer --------------------------------------------------------------------

    def forward(
        self,
        attn,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        pool: torch.Tensor,
        groups: list[AttentionGroup],
        index=None,
    ) -> torch.Tensor:
        """The absorbed groups share one W_UK product before and one W_UV product after their
        attention. With V3.2's `index`, each query attends only to the index_topk keys its indexer
        scores best."""
        cfg = self.cfg
        n, h = q_nope.shape[0], cfg.num_attention_heads
        w_uk, w_uv = self.absorbed_weights(attn)
        if len(groups) == 1 and groups[0].whole and groups[0].expanded:  # (one prompt's prefill)
            return self._expanded(attn, q_nope, q_pe, pool, groups[0], index)
        absorbed = [g for g in groups if not g.expanded]
        expanded = [g for g in groups if g.expanded]
        if not expanded and len(absorbed) == 1 and len(absorbed[0].token_index) == n:
            idx = None  # the common decode step: one group, every query, in order
        else:
            idx = torch.cat([g.token_index for g in absorbed]) if absorbed else None
        out = None if idx is None and absorbed else q_nope.new_empty(n, h, cfg.v_head_dim)
        if absorbed:
            widen_uk, widen_uv = self.absorbed_widen(attn)
            qn, qp = (q_nope, q_pe) if idx is None else (q_nope[idx], q_pe[idx])
            q_lat = absorb_query(qn, w_uk, widen_uk, self.settings.gemv)  # [n', H, r]
            dtype = q_lat.dtype
            if 0 < widen_uk <= q_lat.shape[0]:  # (then the scores and weighted latents in float32 too)
                q_lat, qp = q_lat.float(), qp.float()
            o_lat, at = [], 0
            for g in absorbed:
                k = len(g.token_index)
                o_lat.append(self._absorbed(q_lat[at : at + k], qp[at : at + k], pool, g, _rows_of(index, g)))
                at += k
            o_lat = o_lat[0] if len(o_lat) == 1 else torch.cat(o_lat)
            o = absorb_output(o_lat.to(dtype), w_uv, widen_uv, self.settings.gemv)
            if idx is None:
                return o
            out[idx] = o
        for g in expanded:
            out[g.token_index] = self._expanded(
                attn, q_nope[g.token_index], q_pe[g.token_index], pool, g, _rows_of(index, g)
            )
        return out

    def beside(
        self,
        attn,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        rows: torch.Tensor,
        new: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_cos_sin,
        visible: torch.Tensor | None,
    ) -> torch.Tensor:
        """Decode attention of B tokens over their earlier rows and, beside them, each token's own row
        (not in the pool yet: model/compiled.py's step returns the new rows instead of writing them, as
        a graph that writes into its input copies the input whole). q_nope [B, H, nope], q_pe [B, H,
        rope] (rotated); rows [B, T, width] (key j at position j), `visible` [B, T] which are real (None:
        all); new [B, width] their own rows; cos/sin [T, rope/2] of positions 0..T-1, q_cos_sin those of
        the tokens' positions -> [B, H, v]."""
        cfg = self.cfg
        r, rope, layout = cfg.kv_lora_rank, cfg.qk_rope_head_dim, self.rotary.out_layout
        w_uk, w_uv = self.absorbed_weights(attn)
        q_lat = absorb_query(q_nope, w_uk, per_head=self.settings.gemv)  # [B, H, r]
        c_kv = new[:, :r]
        k_r = encode_pairwise(rows[..., r : r + rope], cos, sin, layout)  # [B, T, rope]
        k_self = encode_pairwise(new[:, r : r + rope], *q_cos_sin, layout)  # each token's own key
        scores = torch.bmm(q_lat, rows[..., :r].transpose(1, 2)) + torch.bmm(q_pe, k_r.transpose(1, 2))
        if visible is not None:
            scores = scores.masked_fill(~visible[:, None], float("-inf"))
        own = (q_lat * c_kv[:, None]).sum(-1, keepdim=True) + (q_pe * k_self[:, None]).sum(-1, keepdim=True)
        p = (torch.cat([scores, own], dim=-1) * cfg.softmax_scale).softmax(dim=-1)  # [B, H, T + 1]
        o_lat = torch.bmm(p[..., :-1], rows[..., :r]) + p[..., -1:] * c_kv[:, None]  # [B, H, r]
        return absorb_output(o_lat, w_uv, per_head=self.settings.gemv)

    def _keys(self, pool: torch.Tensor, g: AttentionGroup, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The group's keys [B, T, r + rope]: [c_KV | k_r encoded at each key's RoPE position]; and
        V3.2's indexer keys [B, T, d] (rotary part encoded likewise, half-split), else None."""
        b, _, t = g.shape
        r, latent = self.cfg.kv_lora_rank, self.cfg.latent_width
        rows = pool.index_select(0, g.key_slots.view(-1)).view(b, t, -1)
        keys = rows[..., :latent].to(dtype)
        self.rotary.encode_cached_(keys[..., r:], g.key_cos, g.key_sin)  # RoPE at read, on the gathered copy
        if not self.cfg.index_head_dim:
            return keys, None
        return keys, encode_half(rows[..., latent:].float(), g.key_cos, g.key_sin)

    def _selected(self, index, idx_keys: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        """V3.2's DSA: the group's mask [B, M, T] narrowed to each query's index_topk best keys."""
        q, w = index  # [n', heads, d] (scaled), [n', heads]
        return dsa_selection(_grid(q, g), _grid(w, g), idx_keys[:, None], g.mask, self.cfg.index_topk)

    def _absorbed(self, q_lat, q_pe, pool, g: AttentionGroup, index=None) -> torch.Tensor:
        """Scores q_lat · c_KV + q_pe · k_r as one product against [c_KV | k_r]; -> o_lat [n, H, r]."""
        cfg = self.cfg
        r, h = cfg.kv_lora_rank, cfg.num_attention_heads
        b, m, t = g.shape
        if g.run is not None and index is None:
            return self._absorbed_in_place(q_lat, q_pe, pool, g)
        keys, idx_keys = self._keys(pool, g, q_lat.dtype)
        mask = g.mask if index is None else self._selected(index, idx_keys, g)
        q = _grid(torch.cat([q_lat, q_pe], dim=-1), g).reshape(b, m * h, r + cfg.qk_rope_head_dim)
        scores = torch.bmm(q, keys.transpose(1, 2)).float() * cfg.softmax_scale  # [B, M * H, T]
        if not g.dense or index is not None:
            scores = scores.view(b, m, h, t).masked_fill(~mask[:, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(q_lat.dtype).view(b, m * h, t)
        return _rows(torch.bmm(probs, keys[..., :r]).view(b * m, h, r), g)

    def _absorbed_in_place(self, q_lat, q_pe, pool, g: AttentionGroup) -> torch.Tensor:
        """`_absorbed` for one sequence whose keys are one run of slots (`AttentionGroup.run`),
        every key visible: c_KV is read where it lies, only k_r (rope wide) is encoded into a copy;
        the scores are q_lat · c_KV + q_pe · k_r as two products instead of one over a gathered copy."""
        cfg = self.cfg
        r, t = cfg.kv_lora_rank, g.shape[2]
        rows = pool[g.run : g.run + t]
        c_kv = rows[:, :r]
        k_r = self.rotary.encode_cached(rows[:, r : cfg.latent_width], g.key_cos[0], g.key_sin[0]).to(q_lat.dtype)
        n, h = q_lat.shape[:2]
        scores = torch.addmm(torch.mm(q_pe.reshape(n * h, -1), k_r.t()), q_lat.reshape(n * h, r), c_kv.t())
        probs = (scores.float() * cfg.softmax_scale).softmax(dim=-1).to(q_lat.dtype)
        return torch.mm(probs, c_kv).view(n, h, r)

    def _expanded(self, attn, q_nope, q_pe, pool, g: AttentionGroup, index=None) -> torch.Tensor:
        """Keys and values expanded from the latent (k_nope = c_KV·W_UK, v = c_KV·W_UV), then SDPA."""
        cfg = self.cfg
        r, h = cfg.kv_lora_rank, cfg.num_attention_heads
        b, m, t = g.shape
        keys, idx_keys = self._keys(pool, g, q_nope.dtype)
        if index is not None:  # V3.2: the mask narrowed to the indexer's picks; no plain causal path
            g = dataclasses.replace(g, explicit_mask=self._selected(index, idx_keys, g), causal=False)
        kv = attn.kv_b_proj(keys[..., :r]).view(b, t, h, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        return self._expanded_attention(q_nope, q_pe, k_nope, keys[..., r:], v, g, selected=index is not None)

    def _expanded_attention(self, q_nope, q_pe, k_nope, k_pe, v, g: AttentionGroup, selected: bool) -> torch.Tensor:
        """Expanded attention of the group's queries q_nope / q_pe [n, H, ·] over k_nope [B, T, H, nope],
        the shared k_pe [B, T, rope] (encoded) and v [B, T, H, v] under g's mask -> [n, H, v] (SDPA)."""
        cfg = self.cfg
        h = cfg.num_attention_heads
        b, m, t = g.shape
        nope, qk = cfg.qk_nope_head_dim, cfg.qk_head_dim
        pads = self._pads(q_nope.device)
        width = max(qk, cfg.v_head_dim) if pads else qk
        # q, k and v head-major ([B, H, M or T, width], each head's rows contiguous, as the flash
        # kernel reads them best), assembled in place of a concatenation (zeros beyond the qk width
        # add nothing to a score; zero v columns give zero output columns, dropped)
        q = q_nope.new_empty(b, h, m, width)
        q[..., :nope] = _grid(q_nope, g).transpose(1, 2)
        q[..., nope:qk] = _grid(q_pe, g).transpose(1, 2)
        q[..., qk:] = 0
        k = k_nope.new_empty(b, h, t, width)  # [k_nope | k_r | zeros]: every head's k_r the shared one
        k[..., :nope] = k_nope.transpose(1, 2)
        k[..., nope:qk] = k_pe[:, None]
        k[..., qk:] = 0
        v = (_widen(v, width) if pads else v).transpose(1, 2).contiguous()
        # NOTE: causal: padded keys (beyond a shorter sequence) are seen only by its padded queries
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if g.causal else g.mask[:, None], is_causal=g.causal, scale=cfg.softmax_scale
        )
        o = o.transpose(1, 2)[..., : cfg.v_head_dim]  # (any zero columns of a widened v dropped)
        return _rows(o.reshape(b * m, h, cfg.v_head_dim), g)


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., w] with zero columns appended up to `width` (x itself when it is that wide)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _buckets(ids: list[int], seqs: list[SeqAttention]) -> list[list[int]]:
    """Split sequences into groups whose padded work stays within PADDING_SLACK of the real work:
    longest first, a sequence joins the current group while the group stays within the slack."""
    order = sorted(ids, key=lambda i: len(seqs[i].key_slots), reverse=True)
    out: list[list[int]] = []
    work = 0
    for i in order:
        s = seqs[i]
        real = len(s.q_positions) * len(s.key_slots)
        if out:
            g = out[-1]
            m = max(len(s.q_positions), *(len(seqs[j].q_positions) for j in g))
            padded = (len(g) + 1) * m * len(seqs[g[0]].key_slots)
            if padded <= PADDING_SLACK * (work + real):
                g.append(i)
                work += real
                continue
        out.append([i])
        work = real
    return [sorted(g) for g in out]


def _rows_of(index, g: AttentionGroup):
    """The indexer's inputs for a group's queries (None without an indexer)."""
    return None if index is None else tuple(x[g.token_index] for x in index)


def _grid(x: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """Flat rows [n, ...] of the group's queries -> the padded grid [B, M, ...]."""
    b, m, _ = g.shape
    if x.shape[0] == b * m:  # no padding (every decode group): the rows are already in grid order
        return x.reshape((b, m) + tuple(x.shape[1:]))
    out = x.new_zeros((b * m,) + tuple(x.shape[1:]))
    out[g.grid_index] = x
    return out.view((b, m) + tuple(x.shape[1:]))


def _rows(grid: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """The padded grid [B * M, ...] -> the group's query rows [n, ...]."""
    return grid if len(g.grid_index) == grid.shape[0] else grid[g.grid_index]
