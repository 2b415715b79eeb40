"""Chunk stores behind the registry interface: memory (default), disk, Redis, and their tiering.

``open_registry`` turns ``--store`` specs into one registry: ``memory`` (always the first tier),
``disk:PATH`` and ``redis://host:port/db``, in that order whatever order they are given in.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from irminsul.kvcache.registry import ChunkStore, MemoryRegistry, Registry
from irminsul.kvcache.store.stats import TierStats, memory_tier_stats

if TYPE_CHECKING:
    from irminsul.kvcache.store.codec import CorruptEntry, ForeignEntry, RowLayout, decode, encode

# the codec's names (it imports torch) are loaded when first asked for: the server's command line
# reads StoreConfig without loading torch
_CODEC = ("CorruptEntry", "ForeignEntry", "RowLayout", "decode", "encode")


def __getattr__(name: str):
    if name in _CODEC:
        return getattr(importlib.import_module("irminsul.kvcache.store.codec"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class StoreConfig:
    specs: tuple[str, ...] = ("memory",)
    memory_bytes: int = 512 * 2**20  # the engine sizes its memory tier by its pool instead
    disk_bytes: int = 8 * 2**30
    redis_ttl_s: int | None = None  # expire Redis entries after this many seconds (None: never)
    redis_timeout_s: float = 0.25  # the deadline of one Redis command, connection and whole reply included

    def __post_init__(self):
        for spec in self.specs:
            if spec != "memory" and not spec.startswith(("disk:", "redis://", "rediss://", "unix://")):
                raise ValueError(f"--store {spec!r} is not a store; use memory, disk:PATH or redis://host:port/db")
            if spec == "disk:":
                raise ValueError("--store disk: needs a directory, e.g. disk:/var/cache/irminsul")
        if self.memory_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("store budgets must be >= 0 bytes")
        if self.redis_ttl_s is not None and self.redis_ttl_s < 1:
            raise ValueError(f"--redis-ttl {self.redis_ttl_s} must be >= 1 second")
        if not self.redis_timeout_s > 0:
            raise ValueError(f"the Redis command deadline ({self.redis_timeout_s} s) must be > 0 seconds")

    @property
    def disk_path(self) -> str | None:
        return next((s.removeprefix("disk:") for s in self.specs if s.startswith("disk:")), None)

    @property
    def redis_url(self) -> str | None:
        return next((s for s in self.specs if s != "memory" and not s.startswith("disk:")), None)


def open_registry(config: StoreConfig, layout: RowLayout, memory_bytes: int | None = None) -> ChunkStore:
    memory = MemoryRegistry(config.memory_bytes if memory_bytes is None else memory_bytes)
    lower: list[Registry] = []
    if config.disk_path:
        from irminsul.kvcache.store.disk import DiskRegistry

        lower.append(DiskRegistry(config.disk_path, layout, config.disk_bytes))
    if config.redis_url:
        from irminsul.kvcache.store.redis import RedisRegistry

        lower.append(
            RedisRegistry(config.redis_url, layout, timeout_s=config.redis_timeout_s, ttl_s=config.redis_ttl_s)
        )
    if not lower:
        return memory
    from irminsul.kvcache.store.tiered import TieredRegistry

    return TieredRegistry(memory, lower)


def tier_stats(registry: Registry) -> list[TierStats]:
    """One TierStats per tier of any registry this package builds."""
    from irminsul.kvcache.store.tiered import TieredRegistry

    if isinstance(registry, TieredRegistry):
        return registry.all_tier_stats
    if (stats := registry.tier_stats) is not None:
        return [stats]
    return [memory_tier_stats(registry)]


__all__ = [
    "CorruptEntry",
    "ForeignEntry",
    "RowLayout",
    "StoreConfig",
    "TierStats",
    "decode",
    "encode",
    "open_registry",
    "tier_stats",
]
