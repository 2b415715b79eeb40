"""The routed experts of an MoE layer in Triton: one grouped launch per product, no host sync.

The torch MoE (`layers.MoE`) either loops over the experts hit or pads every expert's batch to the
busiest one's, and it reads that count on the host (`int(counts.max())`): a synchronisation in
every MoE layer of every step. Here, as vLLM's fused MoE does, the (token, expert) assignments are
sorted by expert on the device and each expert's run is padded to a multiple of BLOCK_M rows, so
that every block of rows belongs to one expert. The number of blocks has a bound the host knows
without looking (assignments + experts × (BLOCK_M − 1), over BLOCK_M), so the grid is fixed; a
block past the last one used finds no expert and returns at once.

Two kernels over the stacked, input-major weights `MoE.stacked()` keeps (gate|up [E, H, 2I], down
[E, I, H]):
  1. per block and column tile: x[rows] · gate|up[e], then silu(gate) * up  -> act [blocks·BM, I];
  2. per block and column tile: act · down[e], times the routing weight     -> y [assignments, H];
then each token's k rows are summed in torch (deterministic: no atomics).

Tested against the torch experts under Triton's interpreter (tests/model/test_triton_moe.py);
the bf16 tensor-core path (LOW) runs on a GPU only, as in attention/triton.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from irminsul.model.attention.triton import INTERPRETED, available

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch MoE needs none of this
    triton = None


class MoeTiles(NamedTuple):
    """The kernels' tile sizes: assignment rows per block (one expert each; tl.dot needs 16), output
    columns and inner dimension per step, and Triton's warps and pipeline stages per program."""

    block_m: int = 16
    block_n: int = 32
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 2


# NOTE: not tuned on a GPU yet: `python benchmarks/gpu_tiles.py` (run by gpu_check.sh) times the
# alternatives on one and prints the best per shape
TILES = MoeTiles()
BLOCK_M = TILES.block_m


def align(ids: torch.Tensor, experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [n, k] -> (rows [blocks · block_m]: the flat assignment index in each row, or
    n · k for padding; block_expert [blocks]: each block's expert, or `experts` when unused).
    Device ops only: nothing is read back to the host."""
    flat = ids.reshape(-1)
    a = flat.numel()
    blocks = (a + experts * (block_m - 1) + block_m - 1) // block_m  # bound known without a sync
    # NOTE: not torch.bincount: on CUDA it reads the largest id back to size its output (a host sync)
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(a, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert]
    rows = torch.full((blocks * block_m,), a, dtype=torch.int64, device=ids.device)
    rows.scatter_(0, (ends - padded)[expert] + rank, order)
    starts = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True)  # == experts past the last used block
    return rows, block_expert


def fused_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    tiles: MoeTiles = TILES,
) -> torch.Tensor:
    """sum_j weights[t, j] · expert_{ids[t, j]}(x[t]) for every token t: x [n, H], weights [n, k]
    (float32), ids [n, k]; gate_up [E, H, 2I] and down [E, I, H] (`MoE.stacked`) -> [n, H]."""
    why = available()
    if why is not None:
        raise RuntimeError(why)
    n, k = ids.shape
    experts, hidden, inner2 = gate_up.shape
    inner = inner2 // 2
    x = x.contiguous()
    rows, block_expert = align(ids, experts, tiles.block_m)
    blocks = block_expert.shape[0]
    act = torch.empty(blocks * tiles.block_m, inner, dtype=torch.float32, device=x.device)
    y = torch.zeros(n * k, hidden, dtype=torch.float32, device=x.device)
    flat_w = weights.reshape(-1).float().contiguous()
    low = x.dtype in (torch.bfloat16, torch.float16) and not INTERPRETED
    meta = dict(
        LOW=low,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    _gate_up[(blocks, triton.cdiv(inner, tiles.block_n))](
        x,
        gate_up,
        rows,
        block_expert,
        act,
        n * k,
        k,
        experts,
        hidden,
        inner,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        act.stride(0),
        **meta,
    )
    _down[(blocks, triton.cdiv(hidden, tiles.block_n))](
        act,
        down,
        rows,
        block_expert,
        flat_w,
        y,
        n * k,
        experts,
        inner,
        hidden,
        act.stride(0),
        down.stride(0),
        down.stride(1),
        y.stride(0),
        **meta,
    )
    return y.view(n, k, hidden).sum(1).to(x.dtype)


if triton is not None:

    @triton.jit
    def _block_rows(rows, blk, n_assign, BLOCK_M: tl.constexpr):
        """A block's rows: their indices, the assignment each holds, and which are real (not padding)."""
        offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        a = tl.load(rows + offs_m)
        return offs_m, a, a < n_assign

    @triton.jit
    def _gate_up(
        x,
        w,
        rows,
        block_expert,
        act,
        n_assign,
        top_k,
        n_experts,
        H,
        I,
        s_x,
        s_we,
        s_wh,
        s_act,
        LOW: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One block of rows (one expert) x one tile of I columns: silu(x·W_gate) * (x·W_up)."""
        blk = tl.program_id(0)
        e = tl.load(block_expert + blk)
        if e < n_experts:
            offs_m, a, live = _block_rows(rows, blk, n_assign, BLOCK_M)
            token = tl.where(live, a // top_k, 0)
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            nm = offs_n < I
            g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, H, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                km = offs_k < H
                xs = tl.load(x + token[:, None] * s_x + offs_k[None, :], mask=live[:, None] & km[None, :], other=0.0)
                base = w + e * s_we + offs_k[:, None] * s_wh
                wg = tl.load(base + offs_n[None, :], mask=km[:, None] & nm[None, :], other=0.0)
                wu = tl.load(base + I + offs_n[None, :], mask=km[:, None] & nm[None, :], other=0.0)
                if LOW:
                    g += tl.dot(xs, wg)
                    u += tl.dot(xs, wu)
                else:  # fp32: exact products (no tf32), as torch computes them
                    g += tl.dot(xs.to(tl.float32), wg.to(tl.float32), input_precision="ieee")
                    u += tl.dot(xs.to(tl.float32), wu.to(tl.float32), input_precision="ieee")
            out = g / (1.0 + tl.exp(-g)) * u
            tl.store(act + offs_m[:, None] * s_act + offs_n[None, :], out, mask=live[:, None] & nm[None, :])

    @triton.jit
    def _down(
        act,
        w,
        rows,
        block_expert,
        route_w,
        y,
        n_assign,
        n_experts,
        I,
        H,
        s_act,
        s_we,
        s_wi,
        s_y,
        LOW: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One block of rows (one expert) x one tile of H columns: act·W_down, times each row's
        routing weight, into the row's assignment."""
        blk = tl.program_id(0)
        e = tl.load(block_expert + blk)
        if e < n_experts:
            offs_m, a, live = _block_rows(rows, blk, n_assign, BLOCK_M)
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            nm = offs_n < H
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, I, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                km = offs_k < I
                h = tl.load(
                    act + offs_m[:, None] * s_act + offs_k[None, :], mask=live[:, None] & km[None, :], other=0.0
                )
                wd = tl.load(
                    w + e * s_we + offs_k[:, None] * s_wi + offs_n[None, :], mask=km[:, None] & nm[None, :], other=0.0
                )
                if LOW:
                    acc += tl.dot(h.to(wd.dtype), wd)
                else:
                    acc += tl.dot(h, wd.to(tl.float32), input_precision="ieee")
            rw = tl.load(route_w + tl.where(live, a, 0), mask=live, other=0.0)
            tl.store(y + a[:, None] * s_y + offs_n[None, :], acc * rw[:, None], mask=live[:, None] & nm[None, :])
