"""Content-addressed registry: chunk fingerprint -> (token ids, rows, base_pos).

Design doc section 3 step 5 and section 6: every hit is verified by comparing token ids and the
namespace that wrote the entry, so a fingerprint collision is a miss and never serves another
chunk's rows, nor another tenant's rows of the same chunk (isolation does not rest on the
fingerprint alone, which a 64-bit hash bounds but does not guarantee). Entries in use by a running
request are pinned and never evicted. ``Registry`` is the interface the planner sees; the disk and
Redis tiers implement it too. ``MemoryRegistry`` is the in-process LRU tier; ``ScopedRegistry`` is
one namespace's view of a registry shared by several. ``ChunkStore`` is what a KV manager needs of
the registry it runs over: a memory tier alone, or the store's tiers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

    from irminsul.kvcache.store.stats import TierLog, TierStats


def namespace_id(model_id: str, tenant: str) -> str:
    """The namespace an entry records and every hit compares: a BLAKE2b digest of the model identity
    and the tenant (length-prefixed, so unambiguous), independent of the fingerprint's xxHash64."""
    data = b"".join(struct.pack("<Q", len(p)) + p for p in (model_id.encode(), tenant.encode()))
    return hashlib.blake2b(data, digest_size=16, person=b"irminsul-ns").hexdigest()


@dataclass(frozen=True, eq=False)
class Entry:
    fingerprint: int
    token_ids: np.ndarray  # [len] int32/int64: the chunk's ids, compared on every hit
    base_pos: int  # absolute position of token_ids[0] when its rows were computed
    # what holds the chunk's rows: the engine's memory tier names pool slots ([len] int64), the disk
    # and Redis tiers hold the rows themselves ([n_layers, len, row_width] tensor), replays hold None
    payload: np.ndarray | torch.Tensor | None
    nbytes: int  # bytes charged against the budget
    namespace: str = ""  # namespace_id of the tenant that wrote it, compared on every hit

    def __len__(self) -> int:
        return len(self.token_ids)

    def matches(self, token_ids: np.ndarray, namespace: str) -> bool:
        """A hit: the same chunk, written in the same namespace."""
        return self.namespace == namespace and np.array_equal(self.token_ids, token_ids)


def slots_of(entry: Entry) -> np.ndarray:
    """The pool slots an entry of the engine's memory tier names (its only kind of payload there)."""
    slots = entry.payload
    assert isinstance(slots, np.ndarray), f"entry {entry.fingerprint:#x} names no pool slots"
    return slots


@dataclass(frozen=True)
class RegistryStats:
    hits: int
    misses: int  # includes collisions
    collisions: int  # fingerprint matched, token ids did not
    evictions: int
    insertions: int
    rejected: int  # puts that could not fit even after evicting every unpinned entry
    entries: int
    pinned: int  # entries with a pin count > 0
    bytes: int
    budget_bytes: int


class Registry(ABC):
    """Fingerprint -> Entry store with verified hits, a byte budget, pinning and stats."""

    log: TierLog | None = None  # a lower tier's TierLog (store/stats.py), which the tiered registry shares

    @property
    def available(self) -> bool:
        """False while a remote backend does not answer (a Redis tier's breaker)."""
        return True

    @property
    def key_prefix(self) -> str | None:
        """What a shared store's keys start with (a Redis tier's), else None."""
        return None

    @property
    def tier_stats(self) -> TierStats | None:
        """A lower tier's TierStats (the disk and Redis tiers have them), else None."""
        return None

    @property
    def location(self) -> str:
        """Where the tier keeps its entries, for people (a log line)."""
        return type(self).__name__

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (at most timeout seconds) until queued writes are done; whether they are."""
        return True

    def close(self) -> None:  # noqa: B027 (a hook: a tier without threads has nothing to stop)
        """Stop the tier's threads and connections (none by default)."""

    def __init__(self) -> None:
        # Called with every entry that enters the store, and with every entry that leaves it
        # (evicted or replaced), e.g. so that a WindowIndex can drop its windows, or so that the
        # engine counts the pool slots an entry refers to.
        self.on_store: list[Callable[[Entry], None]] = []
        self.on_evict: list[Callable[[Entry], None]] = []

    @abstractmethod
    def get(self, fingerprint: int, token_ids: np.ndarray, namespace: str = "") -> Entry | None:
        """The entry if its token ids equal ``token_ids`` and it was written in ``namespace``; counts
        hit/miss/collision, touches LRU."""

    @abstractmethod
    def peek(self, fingerprint: int) -> Entry | None:
        """The entry under ``fingerprint``, unverified, without stats or LRU touch (S1 candidates)."""

    @abstractmethod
    def put(self, entry: Entry) -> bool:
        """Store ``entry`` (replacing one with the same fingerprint); False if it cannot fit."""

    @abstractmethod
    def pin(self, fingerprint: int) -> None:
        """Protect an entry from eviction; pins are counted and survive replacement."""

    @abstractmethod
    def unpin(self, fingerprint: int) -> None:
        """Undo one ``pin``."""

    @abstractmethod
    def __contains__(self, fingerprint: int) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @property
    @abstractmethod
    def stats(self) -> RegistryStats: ...

    def _notify(self, entry: Entry) -> None:
        for callback in self.on_evict:
            callback(entry)

    def _notify_store(self, entry: Entry) -> None:
        for callback in self.on_store:
            callback(entry)


class ChunkStore(Protocol):
    """What a KV manager runs over: a content registry whose memory tier's entries name pool slots,
    and the tiers below it (disk, Redis) that hold the rows themselves. Two implementations: a
    `MemoryRegistry` alone (no tiers below) and the store's `TieredRegistry`."""

    on_store: list[Callable[[Entry], None]]
    on_evict: list[Callable[[Entry], None]]

    @property
    def memory(self) -> MemoryRegistry:
        """The tier whose entries' payloads are pool slots (the manager evicts them with their rows)."""

    @property
    def lower(self) -> Sequence[Registry]:
        """The tiers below memory, in lookup order (empty: memory only)."""

    @property
    def key_prefix(self) -> str | None: ...

    def bind(self, promote: Callable[[Entry], Entry | None], to_lower: Callable[[Entry], Entry]) -> None:
        """How entries move between memory (slots) and the lower tiers (rows)."""

    def prefetch(self, wanted: list[tuple[int, np.ndarray, str]]) -> int:
        """Stage lower-tier entries ahead of the lookups that will want them (any thread)."""

    @property
    def stats(self) -> RegistryStats: ...

    def get(self, fingerprint: int, token_ids: np.ndarray, namespace: str = "") -> Entry | None: ...
    def peek(self, fingerprint: int) -> Entry | None: ...
    def put(self, entry: Entry) -> bool: ...
    def pin(self, fingerprint: int) -> None: ...
    def unpin(self, fingerprint: int) -> None: ...
    def evict(self, nbytes: int, spare: Callable[[Entry], bool] | None = None) -> int: ...
    def entries(self) -> list[Entry]: ...
    def close(self) -> None: ...
    def __contains__(self, fingerprint: int) -> bool: ...
    def __len__(self) -> int: ...


class PinCounts:
    """Reference counts of pinned fingerprints (a pinned entry is in use and must not be evicted)."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}

    def add(self, fingerprint: int) -> None:
        self._counts[fingerprint] = self._counts.get(fingerprint, 0) + 1

    def remove(self, fingerprint: int) -> None:
        count = self._counts.get(fingerprint, 0)
        if count == 0:
            raise KeyError(f"cannot unpin fingerprint {fingerprint:#x}: it is not pinned")
        if count == 1:
            del self._counts[fingerprint]
        else:
            self._counts[fingerprint] = count - 1

    def __contains__(self, fingerprint: int) -> bool:
        return fingerprint in self._counts

    def __iter__(self):
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)


class MemoryRegistry(Registry):
    """In-memory LRU tier with a strict byte budget: ``bytes <= budget_bytes`` always holds."""

    def __init__(self, budget_bytes: int):
        super().__init__()
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # LRU first, MRU last
        self._pins = PinCounts()
        self._bytes = 0
        self._hits = self._misses = self._collisions = 0
        self._evictions = self._insertions = self._rejected = 0

    def get(self, fingerprint: int, token_ids: np.ndarray, namespace: str = "") -> Entry | None:
        entry = self._entries.get(fingerprint)
        if entry is None or not entry.matches(token_ids, namespace):
            self._misses += 1
            self._collisions += entry is not None
            return None
        self._entries.move_to_end(fingerprint)
        self._hits += 1
        return entry

    def peek(self, fingerprint: int) -> Entry | None:
        return self._entries.get(fingerprint)

    def put(self, entry: Entry) -> bool:
        old = self._entries.get(entry.fingerprint)
        kept = self._bytes - (old.nbytes if old is not None else 0)
        pinned = sum(self._entries[fp].nbytes for fp in self._pins if fp != entry.fingerprint)
        # NOTE: decide before evicting anything, so a rejected put leaves the store untouched.
        if pinned + entry.nbytes > self.budget_bytes:
            self._rejected += 1
            return False
        if old is not None:
            self._remove(entry.fingerprint)
        while kept + entry.nbytes > self.budget_bytes:
            victim = next(fp for fp in self._entries if fp not in self._pins)
            kept -= self._entries[victim].nbytes
            self._remove(victim)
            self._evictions += 1
        self._entries[entry.fingerprint] = entry
        self._bytes += entry.nbytes
        self._insertions += 1
        self._notify_store(entry)
        return True

    def evict(self, nbytes: int, spare: Callable[[Entry], bool] | None = None) -> int:
        """Evict least recently used unpinned entries until ``nbytes`` are freed; returns bytes freed.
        ``spare(entry)``: keep the entries it says True for."""
        freed = 0
        for fp in [fp for fp, e in self._entries.items() if fp not in self._pins and not (spare and spare(e))]:
            if freed >= nbytes:
                break
            freed += self._entries[fp].nbytes
            self._remove(fp)
            self._evictions += 1
        return freed

    def discard(self, fingerprint: int) -> bool:
        """Evict one entry (not a pinned one); True if it was there to evict."""
        if fingerprint not in self._entries or fingerprint in self._pins:
            return False
        self._remove(fingerprint)
        self._evictions += 1
        return True

    def pinned(self, fingerprint: int) -> bool:
        return fingerprint in self._pins

    def pinned_entries(self) -> list[Entry]:
        """The entries a plan in progress holds pins on."""
        return [self._entries[fp] for fp in self._pins if fp in self._entries]

    def pin(self, fingerprint: int) -> None:
        if fingerprint not in self._entries:
            raise KeyError(f"cannot pin fingerprint {fingerprint:#x}: not in the registry")
        self._pins.add(fingerprint)

    def unpin(self, fingerprint: int) -> None:
        self._pins.remove(fingerprint)

    def __contains__(self, fingerprint: int) -> bool:
        return fingerprint in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    # -- a store of one tier (`ChunkStore`) ---------------------------------------------------

    @property
    def memory(self) -> MemoryRegistry:
        return self

    @property
    def lower(self) -> tuple[Registry, ...]:
        return ()

    def bind(self, promote, to_lower) -> None:
        """(No tier below: nothing moves.)"""

    def prefetch(self, wanted) -> int:
        return 0

    @property
    def stats(self) -> RegistryStats:
        return RegistryStats(
            self._hits,
            self._misses,
            self._collisions,
            self._evictions,
            self._insertions,
            self._rejected,
            len(self._entries),
            len(self._pins),
            self._bytes,
            self.budget_bytes,
        )

    def _remove(self, fingerprint: int) -> None:
        entry = self._entries.pop(fingerprint)
        self._bytes -= entry.nbytes
        self._notify(entry)


class ScopedRegistry(Registry):
    """One namespace's view of a shared registry: its lookups see only entries written in that
    namespace, its writes are stamped with it. Pins, stats and callbacks are the shared registry's."""

    def __init__(self, registry: Registry | ChunkStore, namespace: str):
        super().__init__()
        self.registry, self.namespace = registry, namespace
        self.on_store, self.on_evict = registry.on_store, registry.on_evict  # NOTE: shared lists

    def get(self, fingerprint: int, token_ids: np.ndarray, namespace: str = "") -> Entry | None:
        """Always this view's namespace: `namespace` may only repeat it (or be left out)."""
        if namespace not in ("", self.namespace):
            raise ValueError("a scoped registry answers for its own namespace only")
        return self.registry.get(fingerprint, token_ids, self.namespace)

    def peek(self, fingerprint: int) -> Entry | None:
        entry = self.registry.peek(fingerprint)
        return entry if entry is not None and entry.namespace == self.namespace else None

    def put(self, entry: Entry) -> bool:
        return self.registry.put(dataclasses.replace(entry, namespace=self.namespace))

    def pin(self, fingerprint: int) -> None:
        self.registry.pin(fingerprint)

    def unpin(self, fingerprint: int) -> None:
        self.registry.unpin(fingerprint)

    def __contains__(self, fingerprint: int) -> bool:
        # NOTE: the key, whoever holds it: a chunk whose fingerprint another namespace holds is not
        # registered over it (a miss for this namespace, never a replacement of the other's rows).
        return fingerprint in self.registry

    def __len__(self) -> int:
        return len(self.registry)

    @property
    def stats(self) -> RegistryStats:
        return self.registry.stats
