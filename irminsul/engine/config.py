"""An engine's options, as one frozen, validated value: what `build_engine` builds from.

`LLM(...)`, the server's `EngineClient.create`, the fleet's replicas and the research tools all
build their engines from an `EngineConfig`; the keyword options they accept are its fields and
its cache's (`EngineConfig.of`). No numpy or torch here: the command line checks options first.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from irminsul.errors import RequestError
from irminsul.kvcache.config import KVCacheConfig


def _int_at_least(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(f"{name}={value!r} must be an integer >= {low}")


@dataclass(frozen=True)
class EngineConfig:
    """`cache`: the KV cache's options, its reuse mode among them. `max_prefill_tokens`: prompt
    positions one step computes at most. `kv_cache_gib`: the latent pool's size (None: the device's
    default, `build.default_kv_cache_gib`). `compile_decode`: see `ModelRunner` (None: where
    available). `max_running_requests`, `decode_slowdown`: see `Scheduler` (None: no limit on how
    much prefill slows the decoding streams)."""

    cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    max_prefill_tokens: int = 2048
    kv_cache_gib: float | None = None
    compile_decode: bool | None = None
    max_running_requests: int = 256
    decode_slowdown: float | None = 2.0

    def __post_init__(self):
        if not isinstance(self.cache, KVCacheConfig):
            raise RequestError(f"cache={self.cache!r} must be a KVCacheConfig")
        _int_at_least("max_prefill_tokens", self.max_prefill_tokens, 1)
        _int_at_least("max_running_requests", self.max_running_requests, 1)
        gib = self.kv_cache_gib
        if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib < math.inf):
            raise RequestError(f"kv_cache_gib={gib!r} must be a number > 0")
        if self.compile_decode not in (None, True, False):
            raise RequestError(f"compile_decode={self.compile_decode!r} must be True, False or None (where available)")
        slowdown = self.decode_slowdown
        if slowdown is not None and (
            isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not slowdown > 1
        ):
            raise RequestError(f"decode_slowdown={slowdown!r} must be > 1 (or None: no limit)")

    @classmethod
    def options(cls) -> frozenset[str]:
        """The keyword options `of` takes: this config's fields but `cache`, and the cache's."""
        return frozenset(f.name for f in dataclasses.fields(cls) if f.name != "cache") | frozenset(
            f.name for f in dataclasses.fields(KVCacheConfig)
        )

    @classmethod
    def of(cls, **options) -> EngineConfig:
        """From flat keyword options (`reuse="pic", tenant="acme", max_prefill_tokens=512`)."""
        if unknown := sorted(set(options) - cls.options()):
            raise RequestError(
                f"unknown cache option {', '.join(unknown)}; the options are {', '.join(sorted(cls.options()))}"
            )
        cache = {f.name for f in dataclasses.fields(KVCacheConfig)}
        return cls(
            KVCacheConfig(**{k: v for k, v in options.items() if k in cache}),
            **{k: v for k, v in options.items() if k not in cache},
        )

    def replace(self, **options) -> EngineConfig:
        """A copy with some options changed (flat, as `of` takes them)."""
        return EngineConfig.of(**{**self.as_options(), **options})

    def as_options(self) -> dict:
        """The flat keyword options `of` turns back into this config."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cache"}
        return {**dataclasses.asdict(self.cache), **out}

    @property
    def reuse(self) -> str:
        return self.cache.reuse
