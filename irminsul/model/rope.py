"""Rotary embedding of MLA's decoupled key, and the δ-rotation that moves a cached `k_r`.

RoPE composes, R(a)·R(b) = R(a+b), so a row cached at position p and reused at p+δ only needs
`k_r <- R(δ)·k_r` (Irminsul paper, section 3; docs/design.md, section 2). That is exact as long as
R(δ) uses the model's own rotary class: the same `inv_freq` (YaRN frequencies do not depend on
position) and the same pair layout the row was cached in. The attention factor that YaRN
multiplies into cos/sin is already inside the cached `k_r`, so R(δ) uses *unit* cos/sin.

Angles are computed in float64: at p = 1e5 a float32 angle carries ~4e-3 rad of rounding error,
which would dominate everything else this module does. The result is rounded once, to the
storage dtype.
"""

from __future__ import annotations

import math

import torch

from irminsul.model.config import RopeConfig


def inv_freq(rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [dim/2] in float32, exactly as HF `ROPE_INIT_FUNCTIONS` builds them."""
    dim = rope.dim
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if rope.kind == "default":
        return extrapolation
    # YaRN (Peng et al. 2023), as in HF `_compute_yarn_parameters` and DeepSeek-V3 inference/model.py.
    interpolation = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _split(x: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "interleaved":
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _join(a: torch.Tensor, b: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "interleaved":
        return torch.stack((a, b), dim=-1).flatten(-2)
    return torch.cat((a, b), dim=-1)


def _cos_sin(angles: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.cos(angles) * scale).float(), (torch.sin(angles) * scale).float()


class Rotary:
    """The model's rotary class for `k_r` / `q_pe`: frequencies, attention factor and layout."""

    def __init__(self, rope: RopeConfig, device: torch.device | str = "cpu"):
        self.config = rope
        self.inv_freq = inv_freq(rope).to(device)  # [dim/2] float32
        self._inv_freq64 = self.inv_freq.double()
        self.attention_factor = rope.attention_factor
        # Pairs are read in the checkpoint's layout and written in the cache layout.
        self.in_layout = "interleaved" if rope.style in ("v2", "v3_interleave") else "half"
        self.out_layout = rope.cache_layout

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """[n] integer positions -> [n, dim/2] float64 angles."""
        return positions.to(self._inv_freq64.device, torch.float64)[:, None] * self._inv_freq64

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, dim/2] (float32, attention factor included) for encoding at positions [n]."""
        return _cos_sin(self.angles(positions), self.attention_factor)

    def apply(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Encode x [n, ..., dim] (fresh projection, checkpoint layout) at positions [n]; pass
        `cos_sin(positions)` when encoding several tensors at the same positions."""
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions)
        # (inductor generates no code for complex operators: a compiled graph takes the pairwise form)
        if (
            self.in_layout == self.out_layout == "interleaved"
            and not torch.compiler.is_compiling()
            and _complex_view_ok(x)
        ):
            shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
            return _complex_rotate(x, cos.reshape(shape), sin.reshape(shape))
        return self._rotate(x, cos, sin, self.in_layout)

    def table(self, n: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [>= n, dim/2] for positions 0, 1, ... (as `cos_sin`), kept and grown by doubling."""
        have = getattr(self, "_table", None)
        if have is None or have[0].shape[0] < n or have[0].device != torch.device(device or "cpu"):
            size = max(n, 2 * have[0].shape[0] if have is not None else 256)
            self._table = tuple(t.to(device) for t in self.cos_sin(torch.arange(size)))
        return self._table

    def to_cache(self, x: torch.Tensor) -> torch.Tensor:
        """A fresh projection [..., dim] (checkpoint layout) in the cache's pair layout, un-rotated."""
        if self.in_layout == self.out_layout:
            return x
        return _join(*_split(x, self.in_layout), self.out_layout)

    def encode_cached(self, k_r: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Encode un-rotated k_r [..., dim] (cache layout) with cos/sin [..., dim/2] broadcast
        against its leading dims (from `table` or `cos_sin`); computed in fp32, returned in k_r's
        dtype. This is RoPE at read time: the same numbers `apply` gives at those positions."""
        if self.out_layout == "interleaved" and _complex_view_ok(k_r):
            return _complex_rotate(k_r, cos, sin)
        return encode_pairwise(k_r, cos, sin, self.out_layout)

    def encode_cached_(self, k_r: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`encode_cached` in place on k_r (a view into a gathered copy of the pool). For float32
        interleaved pairs, one complex multiply by cos + i·sin: the same products and sums,
        bit-identical to `encode_cached`, about 5x faster on a CPU (no temporaries per pair half)."""
        if self.out_layout == "interleaved" and _complex_view_ok(k_r):
            torch.view_as_complex(k_r.unflatten(-1, (-1, 2))).mul_(torch.complex(cos, sin))
        else:
            k_r.copy_(self.encode_cached(k_r, cos, sin))
        return k_r

    def rotate(self, k_r: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
        """Move cached k_r [n, ..., dim] (cache layout) by δ positions: R(δ)·k_r, unit cos/sin."""
        delta = torch.as_tensor(delta, dtype=torch.float64, device=self._inv_freq64.device)
        angles = delta.reshape(-1, 1) * self._inv_freq64  # [1 or n, dim/2]
        cos, sin = _cos_sin(angles, 1.0)
        return self._rotate(k_r, cos, sin, self.out_layout)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        a, b = _split(x.float(), layout)
        out = _join(a * cos - b * sin, b * cos + a * sin, self.out_layout)
        return out.to(x.dtype)


def encode_pairwise(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str, out_layout: str | None = None
) -> torch.Tensor:
    """The reference encoding: pairs (a, b) of x in `layout` -> (a·cos − b·sin, b·cos + a·sin) in
    `out_layout` (default the same), in fp32, returned in x's dtype; cos/sin broadcast against
    the pairs. The fast paths are bit-identical to it (tests/model/test_rope.py)."""
    a, b = _split(x.float(), layout)
    return _join(a * cos - b * sin, b * cos + a * sin, out_layout or layout).to(x.dtype)


def _complex_view_ok(x: torch.Tensor) -> bool:
    """Whether interleaved pairs of x can be read as complex numbers in place (float32, pairs
    adjacent, every other stride and the offset even)."""
    return (
        x.dtype == torch.float32
        and x.stride(-1) == 1
        and x.storage_offset() % 2 == 0
        and all(st % 2 == 0 for st in x.stride()[:-1])
    )


def _complex_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs of x (float32) times cos + i·sin, as a new tensor: the same products and
    sums as the pairwise formula (bit-identical), in three operations instead of ten."""
    return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * torch.complex(cos, sin)).flatten(-2)


def encode_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] with its first 2 * half dims encoded in the half-split layout (pairs (i, i + half))
    by cos/sin [..., half] (broadcast against x[..., :half]), in fp32; the rest passes through.
    DeepSeek-V3.2's indexer key is rotated this way, unlike its MLA's interleaved k_r."""
    half = cos.shape[-1]
    a, b = x[..., :half].float(), x[..., half : 2 * half].float()
    return torch.cat([(a * cos - b * sin).to(x.dtype), (b * cos + a * sin).to(x.dtype), x[..., 2 * half :]], dim=-1)
