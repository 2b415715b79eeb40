"""The native decode kernels as torch operators, so that a compiled decode step (model/compiled.py)
calls them inside its graph instead of breaking it (a ctypes call cannot be traced):

- `irminsul::mla_decode`: model/native/mla_decode.c over the pool's rows at each sequence's slots,
  with each token's own row (not in the pool yet: the compiled step returns the new rows) as one
  more key;
- `irminsul::moe_experts`: model/native/moe.c, the routed experts of a few tokens (`MoE._native`).

`_moe_experts_bf16` (the same kernel for a bfloat16 model: vdpbf16ps where the CPU has AVX512-BF16,
the weights widened to float32 elsewhere) is called by the eager steps only (the compiled steps are
float32).

`call_prefill_attention` (model/native/prefill_attention.c) is called by the eager prefill only.

Each has a fake implementation (the output's shape) for the tracer. `available()` says whether the
kernels can run here (the native library built). Each call shares its work among torch's threads
(`torch.get_num_threads()`, passed to the kernel), with the same result at any count.
"""

from __future__ import annotations

import torch

from irminsul.model import native


def available() -> bool:
    return native.library() is not None


def call_mla_decode(
    q: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    own: torch.Tensor | None,
    r: int,
    interleaved: bool,
    scale: float,
) -> torch.Tensor:
    """q [B, H, r + rope] (q_lat | q_pe rotated), pool [slots, width] (one layer, float32 or bfloat16 rows),
    slots [B, T] (0: no key), cos/sin [T, rope/2] (key j at position j) or [B or 1, T, rope/2] (each
    sequence's keys' positions), own [B, r + rope] each token's own key (k_r rotated; None: none)
    -> o_lat [B, H, r] float32. (The eager decode groups call it directly, the compiled step through
    `mla_decode`.)"""
    b, h, w = q.shape
    q = q.float().contiguous()
    slots = slots.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    per_sequence = cos.dim() == 3 and cos.shape[0] > 1
    own = None if own is None else own.float().contiguous()
    o = torch.empty(b, h, r)
    rc = native.library().irm_mla_decode(
        q.data_ptr(),
        b,
        h,
        r,
        w - r,
        pool.data_ptr(),
        int(pool.dtype == torch.bfloat16),
        pool.stride(0),
        slots.data_ptr(),
        slots.shape[1],
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0) if per_sequence else 0,
        int(interleaved),
        scale,
        None if own is None else own.data_ptr(),
        0 if own is None else own.stride(0),
        o.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("the native decode attention found no memory for its scores")
    return o


def call_prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_r: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    query_pos: torch.Tensor,
    query_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """model/native/prefill_attention.c over float32 views, read where they lie (each one's last dimension
    contiguous): q_nope [B, M, H, nope], q_pe [B, M, H, rope] (rotated), k_nope [B, T, H, nope], k_r [B, T,
    rope] (rotated, shared by the heads), v [B, T, H, vd], slots [B, T] (0: no key), query_pos [B, M] each
    query's position (key j seen where j <= it), query_len [B] each sequence's real query rows -> [B, M, H,
    vd] (rows past query_len zero). (The expanded prefill groups of model/attention/cpu.py call it.)"""
    b, m, h, _ = q_nope.shape
    t, vd = k_nope.shape[1], v.shape[-1]
    if (
        q_pe.shape[:3] != (b, m, h)
        or k_nope.shape[:3] != (b, t, h)
        or v.shape[:3] != (b, t, h)
        or k_r.shape[:2] != (b, t)
        or slots.shape != (b, t)
        or query_pos.shape != (b, m)
        or query_len.shape != (b,)
    ):
        raise ValueError("the native prefill attention's inputs disagree on their sizes")
    args = []
    for x, dims in ((q_nope, 3), (q_pe, 3), (k_nope, 3), (k_r, 2), (v, 3)):
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            raise ValueError("the native prefill attention reads float32 views with a contiguous last dimension")
        args += [x.data_ptr(), *x.stride()[:dims]]
    slots, query_pos, query_len = (x.to(torch.int64).contiguous() for x in (slots, query_pos, query_len))
    out = torch.empty(b, m, h, vd)
    rc = native.library().irm_prefill_attention(
        b,
        m,
        t,
        h,
        q_nope.shape[3],
        q_pe.shape[3],
        vd,
        *args,
        slots.data_ptr(),
        query_pos.data_ptr(),
        query_len.data_ptr(),
        scale,
        out.data_ptr(),
        *out.stride()[:3],
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("the native prefill attention found no memory for its buffers")
    return out


mla_decode = torch.library.custom_op("irminsul::mla_decode", call_mla_decode, mutates_args=())


@mla_decode.register_fake
def _(q, pool, slots, cos, sin, own, r, interleaved, scale):
    return q.new_empty(q.shape[0], q.shape[1], r, dtype=torch.float32)


def _moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """x [n, H] float32, weights / ids [n, k], gate_up [E, H, 2I], down [E, I, H] (float32, any strides
    the kernel reads: `MoE.stacked`) -> the routed experts' output [n, H]."""
    n, hidden = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    ids, w = ids.contiguous(), weights.to(torch.float32).contiguous()
    out = torch.empty(n, hidden, dtype=torch.float32)
    rc = native.library().irm_moe(
        x.data_ptr(),
        n,
        hidden,
        x.stride(0),
        ids.data_ptr(),
        w.data_ptr(),
        ids.shape[1],
        gate_up.shape[0],
        gate_up.shape[2] // 2,
        gate_up.data_ptr(),
        *gate_up.stride(),
        down.data_ptr(),
        *down.stride(),
        out.data_ptr(),
        hidden,
        torch.get_num_threads(),
    )
    if rc == -2:
        raise ValueError("the router chose an expert id outside [0, n_routed_experts)")
    if rc != 0:
        raise MemoryError("the native experts found no memory for their buffers")
    return out


def moe_bf16_available() -> bool:
    """Whether the bfloat16 experts (`_moe_experts_bf16`) were built (every build has them)."""
    return available() and bool(native.library().irm_moe_has_bf16())


def _moe_experts_bf16(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """`_moe_experts` for a bfloat16 model (model/native/moe.c irm_moe_bf16): x [n, H], gate_up
    [E, H, 2I] and down [E, I, H] bfloat16, both stacks out-major (stride 1 along the input)
    -> [n, H] bfloat16."""
    n, hidden = x.shape
    if x.dtype != torch.bfloat16 or gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16:
        raise ValueError("the bf16 experts read bfloat16 tokens and weights")
    if gate_up.stride(1) != 1 or down.stride(1) != 1:
        raise ValueError("the bf16 experts read out-major stacks (stride 1 along the input)")
    x = x if x.stride(1) == 1 else x.contiguous()
    ids, w = ids.to(torch.int64).contiguous(), weights.to(torch.float32).contiguous()
    out = torch.empty(n, hidden, dtype=torch.bfloat16)
    rc = native.library().irm_moe_bf16(
        x.data_ptr(),
        n,
        hidden,
        x.stride(0),
        ids.data_ptr(),
        w.data_ptr(),
        ids.shape[1],
        gate_up.shape[0],
        gate_up.shape[2] // 2,
        gate_up.data_ptr(),
        gate_up.stride(0),
        gate_up.stride(2),
        down.data_ptr(),
        down.stride(0),
        down.stride(2),
        out.data_ptr(),
        hidden,
        torch.get_num_threads(),
    )
    if rc == -2:
        raise ValueError("the router chose an expert id outside [0, n_routed_experts)")
    if rc != 0:
        raise MemoryError("the native experts found no memory for their buffers")
    return out


moe_experts = torch.library.custom_op("irminsul::moe_experts", _moe_experts, mutates_args=())


@moe_experts.register_fake
def _(x, weights, ids, gate_up, down):
    return x.new_empty(x.shape, dtype=torch.float32)
