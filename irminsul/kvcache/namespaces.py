"""Tenants: each gets its own namespace over the one registry and radix tree of an engine.

A namespace is a planner with the tenant's fingerprint seed, its salted view of the radix tree,
its scoped view of the registry (every hit compares the namespace that wrote the entry) and its
own S1 window index, so nothing crosses tenants. The operator's published documents live in
`SHARED`, which every tenant searches after its own.

A tenant `owner|...` (the server's API key subdivided by a cache_salt) belongs to `owner`: a tenant
share of the pool (`KVCacheManager.make_room`) and the bound on planners are per owner, so that no
choice of salts gets around them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from irminsul.kvcache.chunker import TokenArray, namespace_seed
from irminsul.kvcache.planner import Planner, PlannerConfig
from irminsul.kvcache.radix import Node, PrefixMatch, PrefixPiece, RadixCache
from irminsul.kvcache.registry import ChunkStore, Registry, ScopedRegistry, namespace_id
from irminsul.kvcache.windows import WindowIndex
from irminsul.model.attention import EMPTY_SLOT

SHARED = "\x00shared"  # the operator's published namespace; no request can name it as its tenant


def owner_of(tenant: str) -> str:
    """Whose namespace this is: the tenant a `|`-subdivision (the server's cache_salt) belongs to."""
    return tenant.split("|", 1)[0]


def salt_of(namespace: str) -> int:
    """A namespace's radix salt: a negative id (never a real token) from its BLAKE2b namespace id,
    not from the xxHash64 seed, so a tenant who picks its cache_salt cannot search out another's."""
    return -1 - (int(namespace[:16], 16) >> 2)


class SaltedRadix:
    """One tenant's view of the shared radix tree: every key starts with the tenant's salt token.

    The salt is a negative id, so it never equals a real token: tenants share one pool but can
    never match (or time) each other's prefixes. The salt's own slot is the pool's empty slot.
    """

    def __init__(self, radix: RadixCache, salt: int):
        self.radix, self.salt = radix, salt

    def match(self, tokens: TokenArray) -> PrefixMatch:
        m = self.radix.match(np.concatenate([[self.salt], np.asarray(tokens, dtype=np.int64)]))
        if m.length == 0:
            return PrefixMatch(0, m.node, [])
        first = PrefixPiece(m.values[0].value[1:], m.values[0].length - 1)
        return PrefixMatch(m.length - 1, m.node, [first, *m.values[1:]])

    def insert(self, tokens: TokenArray, slots: np.ndarray) -> int:
        salted = np.concatenate([[self.salt], np.asarray(tokens, dtype=np.int64)])
        return self.radix.insert(salted, np.concatenate([[EMPTY_SLOT], slots]))

    def lock(self, node: Node) -> None:
        self.radix.lock(node)

    def unlock(self, node: Node) -> None:
        self.radix.unlock(node)


class Name(NamedTuple):
    salt: int  # the first token of its keys in the radix tree
    namespace: str  # the namespace id its registry entries record


class Namespaces:
    """tenant -> its planner, created on first use, and owner -> the rows its tenants' caches hold.

    Planners are bounded by `limit` (untrusted cache salts choose tenants): beyond it one goes, the
    least recently used of the owner with the most planners (the requester's own when it has as
    many), so an owner cycling salts forgets its own planners, never those of an owner with fewer;
    while every owner has one, the least recently used goes. A forgotten
    planner's entries and tree nodes stay and age out of the pool with everything else (only its S1
    window index is lost), and they still count as its owner's: the names of every tenant with a
    planner or a cached row are kept apart from the planners (`_forget_names` bounds them).
    """

    def __init__(
        self,
        config: PlannerConfig,
        registry: Registry | ChunkStore,
        radix: RadixCache,
        model_id: str,
        default_tenant: str,
        limit: int = 1024,
    ):
        self.config, self.registry, self.radix = config, registry, radix
        self.model_id, self.default_tenant, self.limit = model_id, default_tenant, limit
        self._planners: OrderedDict[str, Planner] = OrderedDict()  # least recently used first
        self._owned: dict[str, OrderedDict[str, None]] = {}  # owner -> its tenants' planners, the same order
        self._names: dict[str, Name] = {}  # tenant -> its name, while it has a planner or a cached row
        self._by_salt: dict[int, str] = {}  # and back: salt -> tenant, namespace id -> tenant
        self._by_namespace: dict[str, str] = {}
        self._entries: dict[str, int] = {}  # namespace id -> registry entries it wrote (none: no key)
        self._names_bound = 2 * limit
        registry.on_store.append(lambda entry: self._count(entry.namespace, 1))
        registry.on_evict.append(lambda entry: self._count(entry.namespace, -1))

    def __iter__(self):
        return iter(self._planners)

    def __len__(self) -> int:
        return len(self._planners)

    def resolve(self, tenant: str | None) -> str:
        return self.default_tenant if tenant is None else tenant

    def planner(self, tenant: str | None) -> Planner:
        tenant = self.resolve(tenant)
        if tenant not in self._planners:
            salt, name = self._name(tenant)
            fallbacks = [] if tenant == SHARED else [self.planner(SHARED)]
            self._planners[tenant] = Planner(
                self.config,
                ScopedRegistry(self.registry, name),
                SaltedRadix(self.radix, salt),
                WindowIndex(self.config.window),
                seed=namespace_seed(self.model_id, tenant),
                fallbacks=fallbacks,
            )
            if tenant != SHARED:
                self._owned.setdefault(owner_of(tenant), OrderedDict())[tenant] = None
            self._forget_idle(tenant)
            self._forget_names()
        self._planners.move_to_end(tenant)
        if tenant != SHARED:
            self._owned[owner_of(tenant)].move_to_end(tenant)
        return self._planners[tenant]

    def ids(self, tenant: str | None) -> tuple[int, str]:
        """(fingerprint seed, namespace id) of a tenant, without creating its planner."""
        tenant = self.resolve(tenant)
        return namespace_seed(self.model_id, tenant), namespace_id(self.model_id, tenant)

    def _name(self, tenant: str) -> Name:
        if tenant not in self._names:
            name = namespace_id(self.model_id, tenant)
            self._names[tenant] = Name(salt_of(name), name)
            self._by_salt[salt_of(name)], self._by_namespace[name] = tenant, tenant
        return self._names[tenant]

    def _count(self, namespace: str, n: int) -> None:
        count = self._entries.get(namespace, 0) + n
        if count > 0:
            self._entries[namespace] = count
        else:
            self._entries.pop(namespace, None)

    def _forget_idle(self, new: str) -> None:
        """Forget planners beyond the limit (never the shared namespace's nor `new`'s own)."""
        while len(self._planners) > self.limit:
            mine: Mapping[str, None] = self._owned.get(owner_of(new), {})
            most = max((len(tenants) for tenants in self._owned.values()), default=0)
            victim: str | None
            if len(mine) == most > 1:
                victim = next(iter(mine))  # (new is its most recent)
            elif most > 1:
                victim = next(iter(next(t for t in self._owned.values() if len(t) == most)))
            else:  # one each: the least recently used
                victim = next((t for t in self._planners if t not in (SHARED, new)), None)
                if victim is None:
                    return
            self._planners.pop(victim).close()
            owned = self._owned[owner_of(victim)]
            del owned[victim]
            if not owned:
                del self._owned[owner_of(victim)]

    def _forget_names(self) -> None:
        """Forget the names of tenants with no planner and no cached row, once they are twice as many
        as when last looked (so amortised O(1)); the names kept are bounded by the planners, the
        registry's entries and the tree's keys."""
        if len(self._names) <= self._names_bound:
            return
        salts = set(self.radix.firsts())
        for tenant, (salt, name) in list(self._names.items()):
            if tenant not in self._planners and salt not in salts and name not in self._entries:
                del self._names[tenant], self._by_salt[salt], self._by_namespace[name]
        self._names_bound = max(2 * self.limit, 2 * len(self._names))

    def held_rows(self, entries, exclude_owners: set[str]) -> dict[str, np.ndarray]:
        """Per owner (but the excluded and the shared namespace): the distinct slots its tenants'
        tree keys and registry entries name, whether or not their planners still exist.
        O(cached entries and tree nodes)."""
        held: dict[str, list[np.ndarray]] = {}

        def add(tenant: str | None, values) -> None:
            if tenant is not None and tenant != SHARED and owner_of(tenant) not in exclude_owners:
                held.setdefault(owner_of(tenant), []).extend(values)

        for salt in self.radix.firsts():
            add(self._by_salt.get(salt), [np.asarray(v) for v in self.radix.values_under(salt)])
        for e in entries:
            add(self._by_namespace.get(e.namespace), [np.asarray(e.payload)])
        out = {}
        for owner, values in held.items():
            rows = np.concatenate(values)
            named = np.zeros(int(rows.max(initial=EMPTY_SLOT)) + 1, bool)  # (faster than np.unique)
            named[rows] = True
            named[EMPTY_SLOT] = False
            out[owner] = np.flatnonzero(named)
        return out

    def close(self) -> None:
        for planner in self._planners.values():
            planner.close()
