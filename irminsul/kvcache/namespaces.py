"""Tenants: each gets its own namespace over the one registry and radix tree of an engine.

A namespace is a planner with the tenant's fingerprint seed, its salted view of the radix tree,
its scoped view of the registry (every hit compares the namespace that wrote the entry) and its
own S1 window index, so nothing crosses tenants. The operator's published documents live in
`SHARED`, which every tenant searches after its own.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from irminsul.cache.chunker import namespace_seed
from irminsul.cache.planner import Planner, PlannerConfig
from irminsul.cache.radix import PrefixMatch, PrefixPiece, RadixCache
from irminsul.cache.registry import Registry, ScopedRegistry, namespace_id
from irminsul.cache.windows import WindowIndex
from irminsul.model.attention import EMPTY_SLOT

SHARED = "\x00shared"  # the operator's published namespace; no request can name it as its tenant


def owner_of(tenant: str) -> str:
    """Whose namespace this is: the tenant a `|`-subdivision (the server's cache_salt) belongs to."""
    return tenant.split("|", 1)[0]


class SaltedRadix:
    """One tenant's view of the shared radix tree: every key starts with the tenant's salt token.

    The salt is a negative id, so it never equals a real token: tenants share one pool but can
    never match (or time) each other's prefixes. The salt's own slot is the pool's empty slot.
    """

    def __init__(self, radix: RadixCache, salt: int):
        self.radix, self.salt = radix, salt

    def match(self, tokens):
        m = self.radix.match(np.concatenate([[self.salt], np.asarray(tokens, dtype=np.int64)]))
        if m.length == 0:
            return PrefixMatch(0, m.node, [])
        first = PrefixPiece(m.values[0].value[1:], m.values[0].length - 1)
        return PrefixMatch(m.length - 1, m.node, [first, *m.values[1:]])

    def insert(self, tokens, slots: np.ndarray) -> int:
        salted = np.concatenate([[self.salt], np.asarray(tokens, dtype=np.int64)])
        return self.radix.insert(salted, np.concatenate([[EMPTY_SLOT], slots]))

    def lock(self, node) -> None:
        self.radix.lock(node)

    def unlock(self, node) -> None:
        self.radix.unlock(node)


class Namespaces:
    """tenant -> its planner, created on first use; the least recently used beyond `limit` are
    forgotten (untrusted cache salts cannot grow it), though their entries and tree nodes stay and
    age out of the pool with everything else; only their S1 window index is lost."""

    def __init__(self, config: PlannerConfig, registry: Registry, radix: RadixCache, model_id: str,
                 default_tenant: str, limit: int = 1024):
        self.config, self.registry, self.radix = config, registry, radix
        self.model_id, self.default_tenant, self.limit = model_id, default_tenant, limit
        self._planners: OrderedDict[str, Planner] = OrderedDict()
        # tenant -> (its radix salt: the first token of its keys, its namespace id: what its entries record)
        self._names: dict[str, tuple[int, str]] = {}

    def __iter__(self):
        return iter(self._planners)

    def __len__(self) -> int:
        return len(self._planners)

    def resolve(self, tenant: str | None) -> str:
        return self.default_tenant if tenant is None else tenant

    def planner(self, tenant: str | None) -> Planner:
        tenant = self.resolve(tenant)
        if tenant not in self._planners:
            seed, name = namespace_seed(self.model_id, tenant), namespace_id(self.model_id, tenant)
            # a negative id (never a real token) from the BLAKE2b namespace digest, not the xxHash64
            # seed: a tenant who picks its cache_salt cannot search out another tenant's salt
            salt = -1 - (int(name[:16], 16) >> 2)
            self._names[tenant] = salt, name
            fallbacks = [] if tenant == SHARED else [self.planner(SHARED)]
            self._planners[tenant] = Planner(self.config, ScopedRegistry(self.registry, name),
                                             SaltedRadix(self.radix, salt), WindowIndex(self.config.window),
                                             seed=seed, fallbacks=fallbacks)
            self._forget_idle()
        self._planners.move_to_end(tenant)
        return self._planners[tenant]

    def ids(self, tenant: str | None) -> tuple[int, str]:
        """(fingerprint seed, namespace id) of a tenant, without creating its planner."""
        tenant = self.resolve(tenant)
        return namespace_seed(self.model_id, tenant), namespace_id(self.model_id, tenant)

    def _forget_idle(self) -> None:
        for tenant in list(self._planners):
            if len(self._planners) <= self.limit:
                break
            if tenant != SHARED:
                self._planners.pop(tenant).close()
                self._names.pop(tenant, None)

    def held_rows(self, entries, exclude_owners: set[str]) -> dict[str, np.ndarray]:
        """Per owner (but the excluded and the shared namespace): the distinct slots its tenants'
        tree keys and registry entries name. O(cached entries and tree nodes)."""
        owners: dict[str, list[str]] = {}
        for tenant in self._planners:
            if tenant != SHARED and owner_of(tenant) not in exclude_owners:
                owners.setdefault(owner_of(tenant), []).append(tenant)
        if not owners:
            return {}
        by_namespace: dict[str, list[np.ndarray]] = {}
        for e in entries:
            by_namespace.setdefault(e.namespace, []).append(np.asarray(e.payload))
        out = {}
        for owner, tenants in owners.items():
            held = [np.asarray(v) for t in tenants for v in self.radix.values_under(self._names[t][0])]
            held += [p for t in tenants for p in by_namespace.get(self._names[t][1], [])]
            rows = np.unique(np.concatenate(held)) if held else np.zeros(0, np.int64)
            out[owner] = rows[rows != EMPTY_SLOT]
        return out

    def close(self) -> None:
        for planner in self._planners.values():
            planner.close()
