"""Attention over the latent pool on a CPU: the reference backend with the native kernels where they run.

Three paths leave the reference's torch ops for model/native (each checked against the reference in
tests/model/test_native_decode.py and tests/model/test_native_prefill.py):

- decode groups (one query per sequence, at its last key): `mla_decode.c` reads the pool in place,
  every sequence and head in one call, keys rotated as they are read, no gathered copy;
- expanded prefill groups: `prefill_attention.c`, flash blocks over the kv_b product's k_nope and v
  where they lie (no padded head-major copies), the mask from the slots and positions, memory linear
  in the keys; used where the library is built with its vector tiles (AVX2 or AVX-512), as its plain
  loops are slower than SDPA; a bfloat16 group's inputs widened to float32 for it where that was
  measured faster than SDPA's bfloat16 on this machine (`widen_prefill`);
- the compiled decode step's attention (`beside_native`), through the same decode kernel as a torch
  operator (model/native_ops.py).

Anything else (a GPU tensor, V3.2's indexer selection, a dtype the kernels do not take, the library not
built, switched off in the backend's settings: IRMINSUL_NATIVE_DECODE / IRMINSUL_NATIVE_PREFILL = 0 when
the model was loaded) runs the reference's path.
"""

from __future__ import annotations

import numpy as np
import torch

from irminsul.model import kernel_choice, native, native_ops
from irminsul.model.attention.base import SeqAttention, absorb_output, absorb_query
from irminsul.model.attention.reference import AttentionGroup, ReferenceAttention, _grid, _rows
from irminsul.model.rope import encode_pairwise
from irminsul.model.settings import Settings

WIDEN_PROBE = 256  # the prompt length `widen_prefill` times both ways on (a causal group of one sequence)


class CPUAttention(ReferenceAttention):
    """The reference backend with native decode and prefill attention where they run."""

    name = "cpu"
    NATIVE_DECODE = True  # False: decode groups take the reference's torch ops
    NATIVE_PREFILL = True  # False: expanded prefill groups take SDPA

    def __init__(self, cfg, rotary, settings: Settings | None = None):
        super().__init__(cfg, rotary, settings)
        self._widen_prefill: dict[int, bool] = {}  # `widen_prefill`'s answer per thread count

    def native_decode(self, pool: torch.Tensor) -> bool:
        """Whether decode groups take the native kernel: a CPU pool of float32 or bfloat16 rows with
        unit stride, the kernel built, not switched off."""
        return (
            self.NATIVE_DECODE
            and pool.device.type == "cpu"
            and pool.dtype in (torch.float32, torch.bfloat16)
            and pool.stride(1) == 1
            and self.settings.native_decode
            and native_ops.available()
        )

    def native_prefill(self, kv: torch.Tensor, keys: torch.Tensor) -> bool:
        """Whether an expanded group takes the native flash kernel: float32 on a CPU (bfloat16 where
        `widen_prefill`), the library built with its vector tiles, not switched off."""
        if not (
            self.NATIVE_PREFILL
            and kv.device.type == "cpu"
            and kv.dtype == keys.dtype
            and self.settings.native_prefill
            and native_ops.available()
            and bool(native.library().irm_vectorised())
        ):
            return False
        return kv.dtype == torch.float32 or (kv.dtype == torch.bfloat16 and self.widen_prefill())

    def widen_prefill(self) -> bool:
        """Whether bfloat16 expanded groups run the native kernel on float32 copies of their inputs: where
        that was faster than SDPA in bfloat16 on a causal prompt of WIDEN_PROBE tokens at this model's
        widths, on this machine at torch's thread count (timed once, cached per CPU as the linear
        products' times are: `kernel_choice`)."""
        threads = torch.get_num_threads()
        known = self._widen_prefill  # (per thread count: asked for every group of every layer)
        if threads in known:
            return known[threads]
        cfg = self.cfg
        key = (
            f"prefill-widen|{cfg.num_attention_heads}x{cfg.qk_nope_head_dim}+{cfg.qk_rope_head_dim}"
            f"x{cfg.v_head_dim}|threads{torch.get_num_threads()}|{native.fingerprint('prefill_attention.c')}"
        )
        known[threads] = bool(kernel_choice._measured(key, "widen", self._time_widening, self.settings)["widen"])
        return known[threads]

    def _time_widening(self) -> dict:
        cfg = self.cfg
        h, t = cfg.num_attention_heads, WIDEN_PROBE
        g = self.plan([SeqAttention(np.arange(t), np.arange(1, t + 1))], [0], "cpu")[0]
        gen = torch.Generator().manual_seed(t)

        def rand(*shape):
            return torch.randn(*shape, generator=gen).bfloat16()

        q_nope, q_pe = rand(t, h, cfg.qk_nope_head_dim), rand(t, h, cfg.qk_rope_head_dim)
        k_nope, k_pe, v = (
            rand(1, t, h, cfg.qk_nope_head_dim),
            rand(1, t, cfg.qk_rope_head_dim),
            rand(1, t, h, cfg.v_head_dim),
        )
        with torch.inference_mode():
            times = kernel_choice._time(
                {
                    "sdpa": lambda: super(CPUAttention, self)._expanded_attention(
                        q_nope, q_pe, k_nope, k_pe, v, g, False
                    ),
                    "widened": lambda: self._native_expanded(q_nope, q_pe, k_nope, k_pe, v, g),
                }
            )
        return {"widen": times["widened"] * kernel_choice.WIDEN_GAIN < times["sdpa"], **times}

    def _absorbed(self, q_lat, q_pe, pool, g: AttentionGroup, index=None) -> torch.Tensor:
        if g.shape[1] == 1 and g.at_end and index is None and self.native_decode(pool):
            # one query per sequence at its last key: the mask is "every non-empty slot", the kernel's
            q = torch.cat([q_lat, q_pe], dim=-1)
            return native_ops.call_mla_decode(
                q,
                pool,
                g.key_slots,
                g.key_cos,
                g.key_sin,
                None,
                q_lat.shape[2],
                self.rotary.out_layout == "interleaved",
                self.cfg.softmax_scale,
            ).to(q_lat.dtype)
        return super()._absorbed(q_lat, q_pe, pool, g, index)

    def _expanded_attention(self, q_nope, q_pe, k_nope, k_pe, v, g: AttentionGroup, selected: bool) -> torch.Tensor:
        if selected or not self.native_prefill(k_nope, k_pe):
            return super()._expanded_attention(q_nope, q_pe, k_nope, k_pe, v, g, selected)
        return self._native_expanded(q_nope, q_pe, k_nope, k_pe, v, g)

    def _native_expanded(self, q_nope, q_pe, k_nope, k_pe, v, g: AttentionGroup) -> torch.Tensor:
        """`_expanded_attention` through the native kernel (float32; other dtypes widened to it and the
        output rounded back once)."""
        cfg = self.cfg
        b, m, _ = g.shape
        dtype = q_nope.dtype
        if dtype != torch.float32:
            q_nope, q_pe, k_nope, k_pe, v = (x.float() for x in (q_nope, q_pe, k_nope, k_pe, v))
        q_nope, q_pe = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_nope, q_pe))
        o = native_ops.call_prefill_attention(
            _grid(q_nope, g), _grid(q_pe, g), k_nope, k_pe, v, g.key_slots, g.query_pos, g.query_len, cfg.softmax_scale
        )
        return _rows(o.view(b * m, cfg.num_attention_heads, cfg.v_head_dim).to(dtype), g)

    def beside_native(
        self,
        attn,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        pool: torch.Tensor,
        key_slots: torch.Tensor,
        new: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_cos_sin,
    ) -> torch.Tensor:
        """`beside` through the native kernel (`native_ops.mla_decode`), for model/compiled.py's batched
        step: the earlier rows read where they lie in `pool` [slots, width] (one layer) at key_slots
        [B, T] (EMPTY_SLOT: none), no gathered copy; each token's own row `new` [B, width] one more key."""
        cfg = self.cfg
        r, rope, layout = cfg.kv_lora_rank, cfg.qk_rope_head_dim, self.rotary.out_layout
        w_uk, w_uv = self.absorbed_weights(attn)
        q = torch.cat([absorb_query(q_nope, w_uk, per_head=self.settings.gemv), q_pe], dim=-1)  # [B, H, r + rope]
        own = torch.cat([new[:, :r], encode_pairwise(new[:, r : r + rope], *q_cos_sin, layout)], dim=-1)
        o_lat = native_ops.mla_decode(q, pool, key_slots, cos, sin, own, r, layout == "interleaved", cfg.softmax_scale)
        return absorb_output(o_lat.to(q_nope.dtype), w_uv, per_head=self.settings.gemv)
