"""The pool, radix tree and registry as one state machine, driven through the scheduler.

Random admissions (prompts built from a few shared chunks behind varying headers, so exact-prefix
and content hits happen), steps, aborts, preemptions (the pool is small) and cache clears. After
every rule: each slot's reference count equals the number of holders naming it (running and
waiting sequences, radix nodes, registry entries), no referenced slot is on the free list, and the
free count adds up. At the end, with every sequence done and the cache cleared, nothing is held.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from irminsul import LLM
from irminsul.engine.sampling import SamplingParams
from irminsul.model.attention import EMPTY_SLOT

CHUNKS = [np.random.default_rng(i).integers(5, 250, 70).tolist() for i in range(3)]
POOL_ROWS = 450  # a few prompts' worth: admission evicts, decoding preempts


def holders(llm) -> np.ndarray:
    """How many references each slot should have: one per holder that names it."""
    pool, cache, sched = llm.engine.pool, llm.engine.kv, llm.engine.scheduler
    want = np.zeros(pool.n_slots, np.int64)
    named = [s.slots for s in [*sched.running, *sched.waiting]]
    named += cache.radix.values()
    named += [e.payload for e in cache.registry.entries()]
    for slots in named:
        slots = np.asarray(slots, np.int64)
        np.add.at(want, slots[slots != EMPTY_SLOT], 1)
    want[EMPTY_SLOT] = 1
    return want


@pytest.fixture(scope="module")
def machine_llms(tiny_dir):
    per_row = LLM(tiny_dir, reuse="off").engine.pool.bytes_per_slot
    return {
        mode: LLM(tiny_dir, reuse=mode, kv_cache_gib=POOL_ROWS * per_row / 2**30, compile_decode=False)
        for mode in ("prefix", "pic")
    }


class CacheMachine(RuleBasedStateMachine):
    llm = None  # set by the test
    seen = None  # what the runs exercised, summed over examples (the test checks it is not nothing)

    @initialize()
    def start(self):
        self.llm.engine.kv.clear()
        self.seqs = []

    @rule(
        header=st.sampled_from([0, 0, 0, 3, 40]),
        picks=st.lists(st.integers(0, len(CHUNKS) - 1), min_size=1, max_size=3),
        new=st.integers(1, 60),
        tenant=st.sampled_from([None, "a", "b"]),
        sampled=st.booleans(),
    )
    def admit(self, header, picks, new, tenant, sampled):
        prompt = [3 + (header + i) % 200 for i in range(header)] + sum((CHUNKS[p] for p in picks), [])
        params = SamplingParams(max_tokens=new, ignore_eos=True, temperature=1.0 if sampled else 0.0, seed=header)
        seq = self.llm.engine.new_sequence(prompt, params, tenant=tenant)
        self.llm.engine.add_request(seq)
        self.seqs.append(seq)

    @precondition(lambda self: any(s.finished for s in self.seqs))
    @rule(data=st.data(), sampled=st.booleans())
    def resend(self, data, sampled):
        """An earlier prompt again, in its tenant: an exact-prefix hit while the cache still holds it."""
        done = data.draw(st.sampled_from([s for s in self.seqs if s.finished]))
        params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0 if sampled else 0.0, seed=1)
        seq = self.llm.engine.new_sequence(done.tokens[: done.prompt_len], params, tenant=done.tenant)
        self.llm.engine.add_request(seq)
        self.seqs.append(seq)

    @precondition(lambda self: self.llm.engine.has_work)
    @rule(n=st.integers(1, 12))
    def step(self, n):
        for _ in range(n):
            if not self.llm.engine.has_work:
                break
            self.llm.engine.step()

    @precondition(lambda self: self.llm.engine.has_work)
    @rule()
    def drain(self):
        """Run everything to the end: finished sequences fill the tree and the registry."""
        while self.llm.engine.has_work:
            self.llm.engine.step()

    @precondition(lambda self: any(not s.finished for s in self.seqs))
    @rule(data=st.data())
    def abort(self, data):
        live = [s for s in self.seqs if not s.finished]
        self.llm.engine.abort(data.draw(st.sampled_from(live)))

    @rule()
    def clear(self):
        self.llm.engine.kv.clear()

    @invariant()
    def references_balance(self):
        pool = self.llm.engine.pool
        want = holders(self.llm)
        bad = np.nonzero(pool.refs != want)[0]
        assert not len(bad), (
            f"slots {bad[:8].tolist()}: refs {pool.refs[bad[:8]].tolist()}, holders {want[bad[:8]].tolist()}"
        )
        free = pool._free[: pool.free]
        assert not (pool.refs[free] != 0).any(), "a referenced slot is on the free list"
        assert len(np.unique(free)) == len(free) and EMPTY_SLOT not in free
        assert pool.free == int((pool.refs[1:] == 0).sum())

    def teardown(self):
        while self.llm.engine.has_work:
            self.llm.engine.step()
        for seq in self.seqs:
            assert seq.finished and (seq.error is None or seq.finish_reason == "abort"), seq.error
        self.references_balance()
        self.llm.engine.kv.clear()
        pool = self.llm.engine.pool
        assert pool.used == 0, f"{pool.used} rows leaked"
        for seq in self.seqs:
            self.seen["hits"] += seq.stats.prefix_tokens + seq.stats.reused_tokens
            self.seen["preempted"] += seq.stats.preempted
            self.seen["aborted"] += seq.finish_reason == "abort"


@pytest.mark.parametrize("mode", ["prefix", "pic"])
def test_pool_tree_and_registry_keep_their_references_balanced(machine_llms, mode):
    CacheMachine.llm = machine_llms[mode]
    CacheMachine.seen = dict(hits=0, preempted=0, aborted=0)
    run_state_machine_as_test(
        CacheMachine,
        settings=settings(
            max_examples=25,
            stateful_step_count=30,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert all(CacheMachine.seen.values()), CacheMachine.seen  # hits, preemptions and aborts all happened
