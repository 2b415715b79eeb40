"""The KV manager without a model: plans, rows and the one eviction order, in milliseconds.

Rows are never computed here (nothing reads them); the bookkeeping is what is checked: reference
counts against the holders that name each slot, and which rows making room takes."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from irminsul.engine.sampling import SamplingParams
from irminsul.engine.sequence import Sequence
from irminsul.kvcache.manager import MIN_EVICTION, KVCacheManager
from irminsul.kvcache.pool import LatentPool
from irminsul.model.attention import EMPTY_SLOT
from irminsul.model.config import ModelConfig
from irminsul.model.tiny import tiny_config

CFG = ModelConfig.from_dict(tiny_config("v2"))
CHUNKS = [np.random.default_rng(i).integers(5, 250, 90).tolist() for i in range(4)]


def manager(mode: str, rows: int, **options) -> KVCacheManager:
    return KVCacheManager(mode, LatentPool(CFG, rows + 1, torch.float32), CFG.num_hidden_layers, **options)


def serve(kv: KVCacheManager, tokens, tenant=None) -> Sequence:
    """Admit a prompt, 'compute' every pending row, finish it: its rows go to the cache."""
    seq = Sequence(tokens=list(tokens), prompt_len=len(tokens), params=SamplingParams(max_tokens=1), tenant=tenant)
    seq.admit(kv.admission(seq))
    slots = kv.fresh_rows(seq.pending, [tenant])
    assert slots is not None, "the test's pool is too small"
    seq.place(seq.pending, slots)
    seq.take_pending(len(tokens))
    seq.registered = kv.computed(seq)
    seq.finish_reason = "length"
    kv.free(seq)
    seq.release()
    return seq


def holders(kv: KVCacheManager) -> np.ndarray:
    want = np.zeros(kv.pool.n_slots, np.int64)
    for value in [*kv.radix.values(), *[e.payload for e in kv.registry.entries()]]:
        value = np.asarray(value, np.int64)
        np.add.at(want, value[value != EMPTY_SLOT], 1)
    want[EMPTY_SLOT] = 1
    return want


@pytest.mark.parametrize("mode", ["prefix", "pic"])
def test_room_for_ten_rows_costs_about_ten_and_the_newest_prompt_stays_whole(mode):
    kv = manager(mode, 1500)
    a, b = [3 + i % 200 for i in range(600)], CHUNKS[0] * 6 + [7] * 60
    serve(kv, a)
    serve(kv, b)
    cached = len(kv.cached_slots)
    assert cached >= 1190 and kv.pool.used == cached
    assert kv.make_room(kv.pool.free + 10)
    # a registry entry goes whole, so a few more than asked may come free; never the whole cache
    assert cached - len(kv.cached_slots) <= max(10, MIN_EVICTION) + 128
    assert kv.planner(None).radix.match(b).length == len(b)  # B, the newest: every row
    assert kv.planner(None).radix.match(a).length >= 500  # A, the oldest: its head
    assert (kv.pool.refs == holders(kv)).all()


def test_making_room_refuses_without_evicting_when_even_everything_is_not_enough():
    kv = manager("pic", 400)
    serve(kv, CHUNKS[1] * 3)
    cached = len(kv.cached_slots)
    assert not kv.make_room(kv.pool.free + cached + 1)
    assert len(kv.cached_slots) == cached


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["serve", "room"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=3),
            st.integers(0, 30),
            st.sampled_from([None, "t1", "t2"]),
            st.integers(1, 200),
        ),
        min_size=1,
        max_size=25,
    ),
    mode=st.sampled_from(["prefix", "pic"]),
)
def test_the_oldest_cache_only_rows_go_first_and_the_books_balance(ops, mode):
    """Any mix of finished prompts (shared chunks behind varying headers, several tenants) and
    requests for room: making room for n frees at least n when it says so, the oldest rows only
    caches held are among those freed, and every slot's references equal the holders naming it."""
    kv = manager(mode, 900)
    for op, picks, header, tenant, n in ops:
        if op == "serve":
            prompt = [5 + (header * 7 + i) % 240 for i in range(header)] + sum((CHUNKS[p] for p in picks), [])
            if len(prompt) + 1 <= kv.pool.n_slots - 1 - (kv.pool.used - len(kv.cached_slots)):
                serve(kv, prompt, tenant)
        else:
            need, cached = kv.pool.free + n, len(kv.cached_slots)
            candidates = kv.order.evictable(kv.pool.refs)
            oldest = candidates[np.argsort(kv.order.stamp[candidates])][:n]
            ok = kv.make_room(need)
            assert ok == (len(candidates) >= n)
            if ok:
                assert kv.pool.free >= need and (kv.pool.refs[oldest] == 0).all(), "an older row survived"
            else:
                assert len(kv.cached_slots) == cached  # refused: nothing evicted
        assert (kv.pool.refs == holders(kv)).all()
        assert kv.pool.free == int((kv.pool.refs[1:] == 0).sum())
        # the journal a fleet router follows names exactly the registry's resident chunks
        assert set(kv.journal.since(None).added.tolist()) == {e.fingerprint for e in kv.registry.entries()}


def test_a_queue_of_requests_for_one_document_counts_the_document_once():
    kv = manager("pic", 3000)
    doc = np.random.default_rng(7).integers(5, 250, 1440).tolist()  # no one has computed it yet
    queue = [
        Sequence(tokens=[9, 8, 7 + i] * 10 + doc, prompt_len=30 + len(doc), params=SamplingParams(max_tokens=1))
        for i in range(5)
    ]
    alone = kv.queued_tokens(queue[:1])
    assert alone == 30 + len(doc)
    # each later request adds its header and the chunk its header runs into (at most max_len), not
    # the whole document again
    per_request = 30 + kv.planner_config.chunker.max_len
    assert alone < kv.queued_tokens(queue) <= alone + 4 * per_request
    serve(kv, [1, 2, 3] * 10 + doc)  # the registry holds the document now
    assert kv.queued_tokens(queue) <= 5 * per_request
    assert manager("prefix", 3000).queued_tokens(queue) == 5 * (30 + len(doc))  # no content reuse: every token
