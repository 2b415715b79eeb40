"""Reuse executed end to end: rows really move, and where theory says so, the result is exact."""

import numpy as np
import pytest
import torch

from irminsul import LLM, RequestError, Segments
from irminsul.engine.sampling import SamplingParams
from irminsul.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    # With one layer, a token's c_KV depends only on the token: pic must be exact.
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("l1") / "c", num_hidden_layers=1, first_k_dense_replace=1, yarn=True, std=0.3
    )


def _rand(n, seed, lo=0, hi=250):
    return np.random.default_rng(seed).integers(lo, hi, n).tolist()


def _shifted_case(seed=0):
    body = _rand(600, seed)
    first = _rand(40, seed + 1) + body  # the body is cached at offset 40 ...
    second = _rand(157, seed + 2) + body + _rand(5, seed + 3)  # ... and requested at offset 157
    return first, second


def test_pic_reproduces_full_prefill_on_one_layer(one_layer):
    first, second = _shifted_case()
    off = LLM(one_layer, reuse="off")
    ref = off.score(second[:-3], second[-3:])
    for mode, exact in (("pic", True), ("naive", False)):
        llm = LLM(one_layer, reuse=mode)
        llm.generate(first, max_tokens=1)
        got = llm.score(second[:-3], second[-3:])
        stats = llm.last_stats
        assert stats.reused_tokens >= 500, stats
        err = (got - ref).abs().max().item()
        if exact:
            assert err < 1e-4, err
        else:
            assert err > 1e-2, err  # stale k_r: the paper's naive baseline measurably differs


@pytest.mark.parametrize("variant", ["v3", "v32", "glm", "longcat"])
def test_pic_is_exact_for_the_other_families(tmp_path, variant):
    """DeepSeek-V3, GLM-4.7-Flash (interleaved-in, halves-out RoPE, sigmoid routing) and LongCat-Flash
    (scaled latents, shortcut MoE) on one layer, where c_KV depends only on the token. LongCat's
    smallest model is a block of two MLA sublayers, and the second one's c_KV depends on context;
    zeroing its kv_a projection makes it cache nothing (its rows are 0 everywhere), so the block
    is a one-layer model in the sense of the design doc's argument."""
    layers = {"num_layers": 1} if variant == "longcat" else {"num_hidden_layers": 1, "first_k_dense_replace": 0}
    path = make_tiny_checkpoint(tmp_path / variant, variant, yarn=True, std=0.3, **layers)
    if variant == "longcat":
        from safetensors.torch import load_file, save_file

        state = load_file(str(path / "model.safetensors"))
        state["model.layers.0.self_attn.1.kv_a_proj_with_mqa.weight"].zero_()
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    first, second = _shifted_case(2)
    ref = LLM(path, reuse="off").score(second[:-3], second[-3:])
    llm = LLM(path, reuse="pic")
    llm.generate(first, max_tokens=1)
    got = llm.score(second[:-3], second[-3:])
    assert llm.last_stats.reused_tokens >= 400, llm.last_stats  # of the 600-token body
    assert (got - ref).abs().max().item() < 1e-4


def test_reused_rows_are_shared_and_equal_rows_computed_in_place(one_layer):
    """A content hit at another position points the slot table at the cached rows themselves (no
    copy), and on one layer those stored rows equal the rows computed at the new position: the
    pool's k_r is un-rotated, so a row has no position in it."""
    first, second = _shifted_case(5)
    off = LLM(one_layer, reuse="off")
    ref_seq = off.engine.add(second, _params())
    off.engine.prefill(ref_seq)
    ref_rows = off.engine.pool.read(ref_seq.slots)
    off.engine.finish(ref_seq)
    pic = LLM(one_layer, reuse="pic")
    pic.generate(first, max_tokens=1)
    cached = np.concatenate([e.payload for e in pic.engine.kv.registry.entries()])
    seq = pic.engine.add(second, _params())
    reused = [s for s in seq.reuse_plan.spans if s.kind == "reuse"]
    assert reused and all(s.delta == 117 for s in reused)
    for s in reused:
        assert np.isin(seq.slots[s.start : s.end], cached).all()  # the registry's own slots
        got = pic.engine.pool.read(seq.slots[s.start : s.end])
        assert torch.allclose(got, ref_rows[:, s.start : s.end], atol=1e-5)
    pic.engine.run(seq)


def _params():
    from irminsul.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=1)


def test_prefix_reuse_changes_nothing(tiny_dir):
    off, prefix = LLM(tiny_dir, reuse="off"), LLM(tiny_dir, reuse="prefix")
    system = _rand(300, 7)
    for turn in range(3):
        prompt = system + _rand(20 + turn, 10 + turn)
        a = off.generate(prompt, max_tokens=8, ignore_eos=True)
        b = prefix.generate(prompt, max_tokens=8, ignore_eos=True)
        assert a.token_ids == b.token_ids
        if turn:
            assert b.stats.prefix_tokens >= 300 and b.stats.reused_tokens == 0


def test_stats_add_up_and_generated_output_is_registered(tiny_dir):
    llm = LLM(tiny_dir, reuse="pic")
    prompt = _rand(400, 11)
    out = llm.generate(prompt, max_tokens=300, ignore_eos=True)
    # The generated continuation, shifted behind a new header, is found again.
    tokens = _rand(77, 12) + prompt + out.token_ids + _rand(50, 13)
    seq = llm.engine.add(tokens, _params())
    s = seq.stats
    assert s.prompt_tokens == s.prefix_tokens + s.reused_tokens + s.computed_tokens
    assert s.reused_tokens >= 400 and s.carve_out_tokens <= s.computed_tokens
    generated = range(77 + 400, 77 + 700)
    in_output = sum(
        len(set(range(sp.start, sp.end)) & set(generated)) for sp in seq.reuse_plan.spans if sp.kind == "reuse"
    )
    assert in_output >= 150, seq.reuse_plan.spans
    llm.engine.run(seq)


def test_shifted_body_recovered_behind_random_headers(tiny_dir):
    llm = LLM(tiny_dir, reuse="pic")
    body = _rand(2000, 21)
    llm.generate(_rand(10, 22) + body, max_tokens=1)
    rng = np.random.default_rng(0)
    for i in range(3):
        header = _rand(int(rng.integers(1, 301)), 30 + i)
        r = llm.generate(header + body, max_tokens=1)
        assert r.stats.reused_tokens >= 0.9 * len(body), r.stats


def test_s2_segments_recover_all_but_the_carve_out(tiny_dir):
    llm = LLM(tiny_dir, reuse="pic")
    docs = [_rand(300, 40 + i) for i in range(3)]
    llm.generate(Segments([_rand(50, 50)] + docs), max_tokens=1)
    header = _rand(90, 51)
    r = llm.generate(Segments([header, docs[2], docs[0], docs[1], [7, 8]]), max_tokens=1)
    assert r.stats.reused_tokens == 900, r.stats


def test_one_pool_budget_evicts_cached_rows_to_admit_new_ones(tiny_dir):
    """Running requests and cached content share the pool: once it is full of cached rows, new
    requests evict the least recently used ones instead of failing."""
    probe = LLM(tiny_dir, reuse="pic")
    per_token = probe.engine.pool.bytes_per_slot
    llm = LLM(tiny_dir, reuse="pic", kv_cache_gib=1200 * per_token / 2**30)  # room for 1,200 rows
    pool = llm.engine.pool
    for i in range(6):
        r = llm.generate(_rand(500, 60 + i), max_tokens=2, ignore_eos=True)
        assert r.finish_reason == "length"
        assert pool.used_bytes <= pool.capacity_bytes
        assert llm.stats()["cached_bytes"] <= pool.used_bytes  # everything held is cached (nothing runs)
    assert llm.engine.kv.registry.stats.evictions > 0 and llm.engine.kv.radix.stats.evictions > 0
    assert pool.free + pool.used == pool.n_slots - 1  # no slot lost or double-freed


def test_a_request_that_fits_decodes_to_the_end_beside_cached_rows():
    """A request that reuses part of a cached entry pins only the rows it uses, so the entry's other
    rows can be evicted: with the pool nearly full it still decodes all its tokens when prompt +
    output fit the pool, rather than stopping early or being preempted."""
    probe = LLM(reuse="pic")  # (the bundled model: token ids up to 1,100)
    llm = LLM(reuse="pic", kv_cache_gib=931 * probe.engine.pool.bytes_per_slot / 2**30)
    llm.generate([list(range(10, 500)), list(range(600, 1100))], max_tokens=32, ignore_eos=True)
    r = llm.generate(list(range(10, 900)), max_tokens=32, ignore_eos=True)  # 922 rows of the 931
    assert r.stats.reused_tokens > 0 and r.stats.preempted == 0
    assert len(r.token_ids) == 32 and r.finish_reason == "length"


def test_a_request_larger_than_the_pool_is_refused_clearly(tiny_dir):
    probe = LLM(tiny_dir, reuse="pic")
    llm = LLM(tiny_dir, reuse="pic", kv_cache_gib=300 * probe.engine.pool.bytes_per_slot / 2**30)
    with pytest.raises(RequestError, match="KV pool"):
        llm.generate(_rand(400, 1), max_tokens=2)
    assert llm.generate(_rand(100, 2), max_tokens=2, ignore_eos=True).finish_reason == "length"


def test_tenants_never_reuse_each_other(tiny_dir):
    llm = LLM(tiny_dir, reuse="pic")
    engine = llm.engine
    body = _rand(700, 70)
    seq = engine.add(_rand(40, 71) + body, _params(), tenant="alice")
    engine.run(seq)
    for tenant, expect_hit in (("bob", False), ("alice", True)):
        seq = engine.add(_rand(90, 72) + body, _params(), tenant=tenant)
        assert (seq.stats.reused_tokens > 500) is expect_hit, (tenant, seq.stats)
        engine.finish(seq)
    # the exact prefix is namespaced too
    seq = engine.add(_rand(40, 71) + body, _params(), tenant="carol")
    assert seq.stats.prefix_tokens == 0 and seq.stats.reused_tokens == 0
    engine.finish(seq)


def test_published_documents_are_shared_across_tenants(tiny_dir):
    llm = LLM(tiny_dir, reuse="pic")
    engine = llm.engine
    doc = _rand(600, 80)
    engine.publish(doc)
    for tenant in ("alice", "bob"):
        seq = engine.add(_rand(55, 81) + doc + [5], _params(), tenant=tenant)
        assert seq.stats.reused_tokens >= 500, seq.stats
        engine.finish(seq)
    # content a tenant computed itself stays private even though shared lookups exist
    private = _rand(600, 82)
    engine.run(engine.add(_rand(20, 83) + private, _params(), tenant="alice"))
    seq = engine.add(_rand(33, 84) + private, _params(), tenant="bob")
    assert seq.stats.reused_tokens == 0
    engine.finish(seq)


def test_publishing_without_room_says_whether_a_retry_can_help(tiny_dir):
    """Neither case is a 500 "internal error": a document larger than the pool is the request's
    fault (400, no retry can help); one that fits only once running requests give their rows back
    is PoolBusy (the server answers 503: retry)."""
    from irminsul.engine.engine import PoolBusy

    probe = LLM(tiny_dir, reuse="pic")
    engine = LLM(tiny_dir, reuse="pic", kv_cache_gib=700 * probe.engine.pool.bytes_per_slot / 2**30).engine
    with pytest.raises(RequestError, match="the document has 800 tokens but the KV pool holds") as e:
        engine.publish(_rand(800, 85))
    assert not isinstance(e.value, PoolBusy)
    running = engine.add(_rand(500, 86), _params())  # holds 500 of the 700 rows
    with pytest.raises(PoolBusy, match="retry later"):
        engine.publish(_rand(400, 87))
    engine.finish(running)
    assert engine.publish(_rand(400, 87)).entries > 0  # its rows given back (cached rows are evicted)


def test_pic_plus_r_recomputes_the_most_deviating_rows(tiny_dir):
    first, second = _shifted_case(9)
    ref = LLM(tiny_dir, reuse="off").score(second[:-3], second[-3:])
    errors = {}
    for ratio in (0.0, 0.15, 1.0):
        llm = LLM(tiny_dir, reuse="pic", recompute_ratio=ratio)
        llm.generate(first, max_tokens=1)
        got = llm.score(second[:-3], second[-3:])
        s = llm.last_stats
        assert s.prompt_tokens == s.prefix_tokens + s.reused_tokens + s.computed_tokens
        if ratio == 1.0:
            assert s.reused_tokens == 0 and s.recomputed_tokens > 500
        errors[ratio] = (got - ref).abs().max().item()
    assert errors[1.0] < 1e-4  # recomputing every reused row is full prefill
    assert errors[0.15] <= errors[0.0]


def test_namespaces_are_bounded(tiny_dir):
    llm = LLM(tiny_dir, reuse="pic", max_namespaces=3)
    cache = llm.engine.kv
    callbacks = len(cache.registry.on_evict)
    for i in range(10):
        llm.engine.run(llm.engine.add(_rand(50, 90 + i), _params(), tenant=f"t{i}"))
    assert len(cache.namespaces) <= 3
    assert len(cache.registry.on_evict) <= callbacks + 3


def test_model_visible_marker_restarts_chunking(tiny_dir):
    marker = tuple(_rand(64, 100, 250, 256))
    llm = LLM(tiny_dir, reuse="pic", marker=marker)
    doc = _rand(500, 101)
    llm.generate(_rand(45, 102) + list(marker) + doc, max_tokens=1)
    r = llm.generate(_rand(170, 103) + list(marker) + doc + [9], max_tokens=1)
    assert r.stats.reused_tokens >= len(doc) - 1, r.stats


def test_score_accepts_segments(tiny_dir):
    llm = LLM(tiny_dir, reuse="pic")
    docs = [_rand(200, 110 + i) for i in range(3)]
    llm.score([_rand(40, 120)] + docs, [1, 2])
    ref = LLM(tiny_dir, reuse="off").score(sum([_rand(70, 121), docs[2], docs[0], docs[1]], []), [1, 2])
    got = llm.score([_rand(70, 121), docs[2], docs[0], docs[1]], [1, 2])
    # docs 0 and 1 (and doc 2 except its last chunk, registered with the continuation after it)
    assert llm.last_stats.reused_tokens >= 450, llm.last_stats
    assert got.shape == ref.shape


@pytest.mark.parametrize("share", [None, 0.4])
def test_a_tenant_share_keeps_one_tenant_from_evicting_another(tiny_dir, share):
    """Bob sends one new 300-token prompt after another into a pool of 1,000 rows. Without a share
    the least recently used rows go first, alice's among them; with tenant_share=0.4, bob's
    admissions evict bob's own cached rows while alice's 340 rows fit in her 40%."""
    per_row = LLM(tiny_dir, reuse="off").engine.pool.bytes_per_slot
    options = {} if share is None else {"tenant_share": share}
    engine = LLM(tiny_dir, reuse="pic", kv_cache_gib=1000 * per_row / 2**30, **options).engine
    doc = _rand(340, 80)
    engine.run(engine.add(doc, _params(), tenant="key:alice"))
    for i in range(6):
        engine.run(engine.add(_rand(300, 81 + i), _params(), tenant=f"key:bob|salt:{i}"))
    seq = engine.add(doc, _params(), tenant="key:alice")
    hit = seq.stats.prefix_tokens + seq.stats.reused_tokens
    engine.finish(seq)
    if share is None:
        assert hit < 100, seq.stats  # what the share is for: bob's traffic flushed alice's cache
    else:
        assert hit >= 330, seq.stats
    pool = engine.pool
    assert pool.free + pool.used == pool.n_slots - 1


def test_a_tenant_share_is_validated(tiny_dir):
    for bad in (0, 1.5, -0.1, "half"):
        with pytest.raises(RequestError, match="tenant_share"):
            LLM(tiny_dir, reuse="pic", tenant_share=bad)


@pytest.mark.parametrize("share", [None, 0.4])
def test_a_tenant_share_holds_while_another_tenant_decodes(tiny_dir, share):
    """The rows a decoding request grows into come first from its own owner's cache too: bob's
    request is admitted into free rows and then decodes past them."""
    per_row = LLM(tiny_dir, reuse="off").engine.pool.bytes_per_slot
    options = {} if share is None else {"tenant_share": share}
    engine = LLM(tiny_dir, reuse="prefix", kv_cache_gib=1000 * per_row / 2**30, **options).engine
    doc = _rand(300, 90)
    engine.run(engine.add(doc, _params(), tenant="key:alice"))
    for i in range(2):  # bob's cached rows fit in his share too
        engine.run(engine.add(_rand(150, 91 + i), _params(), tenant="key:bob"))
    free = engine.pool.free
    long = engine.add(_rand(100, 95), SamplingParams(max_tokens=free - 100 + 60, ignore_eos=True), tenant="key:bob")
    engine.run(long)
    assert long.finish_reason == "length" and long.stats.preempted == 0
    seq = engine.add(doc, _params(), tenant="key:alice")
    hit = seq.stats.prefix_tokens
    engine.finish(seq)
    assert (hit >= 290) if share else (hit < 290), seq.stats


@pytest.mark.parametrize("mode", ["prefix", "pic"])
def test_making_room_for_a_few_rows_evicts_about_that_many(tiny_dir, mode):
    """A and B fill most of a 1,500-row pool; a prompt 10 rows short of fitting evicts about 10
    rows, least recently used first and from the tail (A's prefix keeps its head), across the
    tree and the registry alike: the cache keeps at least 1,000 of its ~1,200 rows and B, sent
    again, is still an exact-prefix hit."""
    per_row = LLM(tiny_dir, reuse="off").engine.pool.bytes_per_slot
    llm = LLM(tiny_dir, reuse=mode, kv_cache_gib=1500 * per_row / 2**30)
    engine, pool = llm.engine, llm.engine.pool
    a, b = _rand(600, 100), _rand(600, 101)
    for prompt in (a, b):
        engine.run(engine.add(prompt, _params()))
    cached = len(engine.kv.cached_slots)
    assert cached >= 1150 and pool.used == cached
    c = _rand(pool.free + 9, 102)  # its rows and its one new token: 10 more than are free
    engine.run(engine.add(c, _params()))
    kept = len(engine.kv.cached_slots)
    seq = engine.add(b, _params())
    assert seq.stats.computed_tokens <= 6, seq.stats  # B: an exact-prefix hit (the last row is always computed)
    engine.finish(seq)
    seq = engine.add(a, _params())
    assert seq.stats.prefix_tokens >= 550, seq.stats  # A lost its tail, not its head
    engine.finish(seq)
    assert kept >= 1000 + len(c) - 20, (kept, cached)  # the old rows (~1,200, less ~10) and C's own
