"""A tenant share holds per owner (an API key), whatever its tenants' cache salts.

The rows an owner's tree keys and registry entries name count as its own whether or not the
planners of its salts still exist; an owner cycling salts forgets its own planners, never those
of an owner with fewer; and nothing a client's choice of salts creates grows without bound."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from irminsul.errors import RequestError
from irminsul.kvcache.namespaces import SHARED, owner_of, salt_of
from irminsul.kvcache.registry import namespace_id
from irminsul.model.attention import EMPTY_SLOT
from tests.kvcache.test_manager import CHUNKS, holders, manager, serve


def _rand(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 250, n).tolist()


def tenant_rows(kv, tenant: str) -> set[int]:
    """The slots a tenant's tree keys and registry entries name, found from its name alone."""
    name = namespace_id("", tenant)
    named = [np.asarray(v) for v in kv.radix.values_under(salt_of(name))]
    named += [np.asarray(e.payload) for e in kv.registry.entries() if e.namespace == name]
    return {int(s) for v in named for s in v if s != EMPTY_SLOT}


def named_rows(kv, tenants) -> dict[str, np.ndarray]:
    """Per owner (the shared namespace aside): the distinct slots its tenants name (no planner, no
    table of the manager's needed)."""
    rows: dict[str, set[int]] = {}
    for tenant in tenants:
        if tenant != SHARED:
            rows.setdefault(owner_of(tenant), set()).update(tenant_rows(kv, tenant))
    return {owner: np.array(sorted(r), np.int64) for owner, r in rows.items() if r}


@pytest.mark.parametrize("limit", [8, 1024])
def test_cycling_cache_salts_does_not_dissolve_another_keys_share(limit):
    """B caches a document; A sends more requests with distinct salts than there are planners, then
    documents of its own (each under a new salt) through a pool that cannot hold them all: admission
    evicts A's rows, B's stay whole, and B's planner was never forgotten."""
    kv = manager("pic", 1000, tenant_share=0.4, max_namespaces=limit)
    doc = _rand(340, 1)
    serve(kv, doc, "key:b")
    for i in range(limit + 8):
        serve(kv, _rand(3, 100 + i), f"key:a|salt:{i}")
    for i in range(8):
        serve(kv, _rand(300, 10 + i), f"key:a|salt:doc{i}")
    assert kv.evicted_rows >= 1400  # A's documents went through the pool
    assert len(tenant_rows(kv, "key:b")) == len(doc)
    assert "key:b" in kv.namespaces
    assert kv.planner("key:b").radix.match(doc).length == len(doc)


def test_an_owner_cycling_salts_forgets_its_own_planners():
    kv = manager("pic", 600, max_namespaces=6)
    for tenant in ("key:b", "key:b|salt:x", "key:c"):
        serve(kv, _rand(40, 2), tenant)
    for i in range(30):
        serve(kv, _rand(40, 3 + i), f"key:a|salt:{i}")
        assert {"key:b", "key:b|salt:x", "key:c"} <= set(kv.namespaces)
    # an owner with more planners than the requester gives up its least recently used
    kv = manager("pic", 600, max_namespaces=5)  # (the shared namespace's planner is one of them)
    for tenant in ("key:b", "key:b|salt:x", "key:b|salt:y", "key:a", "key:a|salt:1"):
        serve(kv, _rand(40, 2), tenant)
    assert set(kv.namespaces) == {SHARED, "key:b|salt:x", "key:b|salt:y", "key:a", "key:a|salt:1"}
    serve(kv, _rand(40, 4), "key:a|salt:2")  # now A has the most: its own goes
    assert set(kv.namespaces) == {SHARED, "key:b|salt:x", "key:b|salt:y", "key:a|salt:1", "key:a|salt:2"}


@pytest.mark.parametrize("mode", ["prefix", "pic"])
def test_cycling_salts_grows_nothing_without_bound(mode):
    """A thousand salts through a pool that holds ten prompts: the planners, the names kept for
    accounting and the tree's keys stay bounded by the limit and by what the pool holds (a salt
    whose rows all went leaves no key behind)."""
    limit, rows, prompt = 4, 400, 40
    kv = manager(mode, rows, max_namespaces=limit)
    most = 0
    for i in range(1000):
        serve(kv, _rand(prompt, i), f"key:a|salt:{i}")
        most = max(most, len(kv.namespaces._names))
    # live: the planners and the salts that hold rows; the names are at most twice the live ones
    assert most <= 2 * (limit + rows // prompt + 1)
    assert len(kv.namespaces) <= limit
    firsts = kv.radix.firsts()
    assert all((np.concatenate(kv.radix.values_under(t)) != EMPTY_SLOT).any() for t in firsts)
    assert len(firsts) <= rows // prompt + 1 and kv.radix.stats.nodes <= 2 * len(firsts)
    assert len(kv.namespaces._entries) <= len(kv.registry)


def test_max_namespaces_leaves_room_for_the_shared_one():
    with pytest.raises(RequestError, match="max_namespaces"):
        manager("pic", 100, max_namespaces=1)


OWNERS = ["key:a", "key:b", ""]
TENANTS = [o if s is None else f"{o}|salt:{s}" for o in OWNERS for s in (None, "0", "1", "2")]


class ShareMachine(RuleBasedStateMachine):
    """Prompts of several owners under several salts, requests for room on an owner's behalf and cache
    clears, with room for 3 planners (so they are forgotten all the time). After every rule: each
    owner's held rows as the manager counts them are the slots its tenants' keys and entries name,
    and the references balance. Room made for one owner leaves every other owner within its share
    whole whenever the rest of the evictable rows were enough."""

    mode = "pic"
    seen = None  # what the runs exercised, summed over examples (the test checks it is not nothing)

    @initialize()
    def start(self):
        self.kv = manager(self.mode, 700, tenant_share=0.3, max_namespaces=3)
        self.used: set[str] = set()

    @rule(
        tenant=st.sampled_from(TENANTS),
        header=st.integers(0, 30),
        picks=st.lists(st.integers(0, len(CHUNKS) - 1), min_size=1, max_size=3),
    )
    def send(self, tenant, header, picks):
        prompt = [5 + (header * 7 + i) % 240 for i in range(header)] + sum((CHUNKS[p] for p in picks), [])
        kv = self.kv
        if len(prompt) + 1 <= kv.pool.n_slots - 1 - (kv.pool.used - len(kv.cached_slots)):
            serve(kv, prompt, tenant)
            self.used.add(tenant)

    @rule(tenant=st.sampled_from(TENANTS), n=st.integers(1, 300))
    def room(self, tenant, n):
        kv = self.kv
        need = kv.pool.free + n
        budget = kv.tenant_share * (kv.pool.n_slots - 1)
        spared = [r for o, r in named_rows(kv, self.used).items() if o != owner_of(tenant) and len(r) <= budget]
        spared = np.concatenate(spared) if spared else np.zeros(0, np.int64)
        others = np.setdiff1d(kv.order.evictable(kv.pool.refs), spared)
        evicted = kv.evicted_rows
        if kv.make_room(need, [tenant]) and len(others) >= n:
            assert (kv.order.held[spared] > 0).all(), "room for one owner took another's rows within its share"
            self.seen["spared"] += len(spared) if kv.evicted_rows > evicted else 0

    @rule()
    def clear(self):
        self.kv.clear()

    @invariant()
    def held_rows_are_the_rows_named(self):
        kv = self.kv
        want = named_rows(kv, self.used)
        got = {o: r for o, r in kv.namespaces.held_rows(kv.registry.entries(), set()).items() if len(r)}
        assert got.keys() == want.keys()
        for owner in want:
            assert np.array_equal(got[owner], want[owner]), owner
        assert (kv.pool.refs == holders(kv)).all()
        assert len(kv.namespaces) <= 3
        self.seen["unplanned"] += sum(1 for t in self.used if t not in kv.namespaces and tenant_rows(kv, t))


@pytest.mark.parametrize("mode", ["prefix", "pic"])
def test_held_rows_are_the_rows_each_owner_names(mode):
    ShareMachine.mode, ShareMachine.seen = mode, {"spared": 0, "unplanned": 0}
    run_state_machine_as_test(
        ShareMachine,
        settings=settings(
            max_examples=40,
            stateful_step_count=30,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    # rows were spared while room was made, and owners held rows under salts whose planners were forgotten
    assert ShareMachine.seen["spared"] > 0 and ShareMachine.seen["unplanned"] > 0, ShareMachine.seen
