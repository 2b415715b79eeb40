"""Pure cache bookkeeping: chunker, registry, S1 window index, radix prefix tree, reuse planner.

These modules need no torch: rows are opaque payloads the engine owns (docs/design.md section 3).
Only the store tiers in `store/`, which serialise rows, import it.
"""

from irminsul.cache.chunker import Chunk, ChunkerConfig, boundaries, chunk, fingerprint, namespace_seed
from irminsul.cache.planner import Plan, Planner, PlannerConfig, PlanStats, Registered, Span
from irminsul.cache.radix import PrefixMatch, RadixCache, RadixStats
from irminsul.cache.registry import Entry, MemoryRegistry, Registry, RegistryStats
from irminsul.cache.windows import WindowHit, WindowIndex

__all__ = [
    "Chunk", "ChunkerConfig", "Entry", "MemoryRegistry", "Plan", "PlanStats", "Planner",
    "PlannerConfig", "PrefixMatch", "RadixCache", "RadixStats", "Registered", "Registry",
    "RegistryStats", "Span", "WindowHit", "WindowIndex", "boundaries", "chunk", "fingerprint",
    "namespace_seed",
]
