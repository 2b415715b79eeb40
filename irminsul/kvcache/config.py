"""The KV cache's options, as one frozen, validated value (`KVCacheManager` is built from it).

A module of its own, without numpy or torch, so that the command line and the server's config check
these options before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from irminsul.errors import RequestError
from irminsul.kvcache.modes import MODES


@dataclass(frozen=True)
class KVCacheConfig:
    """`reuse`: the reuse mode (`modes.py`). `tenant`: the namespace of requests that name none.
    `model_id`: what fingerprints and store keys are salted with (the checkpoint's identity).
    `carve_out`: recompute the rows below the sink (None: pic does, naive does not, as in the paper).
    `s1`: the S1 window index. `marker`: a model-visible boundary sequence that restarts chunking
    (the paper's S2 variant). pic+r: `recompute_ratio` of the reused rows, chosen at `check_layer`.
    `max_namespaces`: tenants' planners kept at once. `tenant_share`: the share of the pool an owner's
    cached rows keep from other tenants' eviction (`KVCacheManager.make_room`; None: no shares)."""

    reuse: str = "off"
    tenant: str = ""
    model_id: str = ""
    carve_out: bool | None = None
    s1: bool = True
    recompute_ratio: float = 0.0
    check_layer: int = 1
    max_namespaces: int = 1024
    marker: tuple[int, ...] | None = None
    tenant_share: float | None = None

    def __post_init__(self):
        if self.reuse not in MODES:
            raise RequestError(f"reuse={self.reuse!r} is not a reuse mode; choose one of {', '.join(MODES)}")
        if self.tenant_share is not None and not (
            isinstance(self.tenant_share, (int, float)) and 0 < self.tenant_share <= 1
        ):
            raise RequestError(f"tenant_share={self.tenant_share!r} must be a share of the pool in (0, 1]")
        if self.max_namespaces < 2:
            raise RequestError(f"max_namespaces={self.max_namespaces} must be at least 2 (one is the shared namespace)")
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise RequestError(f"recompute_ratio={self.recompute_ratio} must be in [0, 1]")
        if self.marker is not None:
            object.__setattr__(self, "marker", tuple(self.marker) or None)

    @property
    def caching(self) -> bool:
        return self.reuse != "off"
