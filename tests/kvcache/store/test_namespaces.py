"""Every hit verifies the namespace that wrote the entry as well as its token ids, in every tier, so
tenant isolation holds even where fingerprints collide."""

import dataclasses

import numpy as np
import pytest
import torch

from irminsul.kvcache import chunker
from irminsul.kvcache.registry import Entry, MemoryRegistry, ScopedRegistry, namespace_id
from irminsul.kvcache.store import StoreConfig, decode, encode, open_registry
from irminsul.kvcache.store.disk import DiskRegistry
from irminsul.kvcache.store.redis import RedisRegistry
from tests.kvcache.store.conftest import LAYOUT

ALICE, BOB = namespace_id("m", "alice"), namespace_id("m", "bob")


def entry(fp, namespace, n=8):
    rows = torch.randn(2, n, 6, generator=torch.Generator().manual_seed(fp))
    return Entry(fp, np.arange(n, dtype=np.int64), 0, rows, rows.numel() * 4, namespace)


def test_namespace_ids_are_distinct_and_survive_the_codec():
    assert ALICE != BOB and namespace_id("m", "") != namespace_id("", "m")
    got = decode(encode(entry(1, ALICE), LAYOUT), LAYOUT, 1)
    assert got.namespace == ALICE


@pytest.mark.parametrize("tier", ["memory", "disk", "redis", "tiered"])
def test_the_same_chunk_under_the_same_fingerprint_is_a_hit_only_in_its_namespace(tier, tmp_path, request):
    if tier == "memory":
        reg = MemoryRegistry(10**6)
    elif tier == "disk":
        reg = DiskRegistry(tmp_path, LAYOUT, 10**6)
    elif tier == "redis":
        reg = RedisRegistry(request.getfixturevalue("redis_proc").url, LAYOUT)
    else:
        reg = open_registry(StoreConfig(("memory", f"disk:{tmp_path}")), LAYOUT, memory_bytes=10**6)
    assert reg.put(entry(7, ALICE))
    getattr(reg, "flush", lambda: True)()
    if tier == "tiered":
        reg.memory.evict(10**9)  # the disk tier answers
    same_ids = np.arange(8)
    assert reg.get(7, same_ids, BOB) is None  # the fingerprint and the token ids match; the namespace does not
    assert reg.get(7, same_ids, ALICE) is not None
    bob = ScopedRegistry(reg, BOB)
    assert bob.get(7, same_ids) is None and bob.peek(7) is None
    if tier == "memory":
        assert ScopedRegistry(reg, ALICE).peek(7) is not None
    getattr(reg, "close", lambda: None)()


def tiny_fingerprints(monkeypatch, bits=6):
    """Fingerprints of the content alone, in 2**bits values: every tenant's copy of a chunk lands on
    the same fingerprint, and different chunks collide too."""
    from irminsul.kvcache import caches, planner

    def fp(ids, seed):
        return chunker.fingerprint(ids, 0) & ((1 << bits) - 1)

    def chunk(tokens, cfg, seed, segment_starts=None, fingerprint_fn=None):
        return chunker.chunk(tokens, cfg, seed, segment_starts, fp)

    for module in (planner, caches):
        monkeypatch.setattr(module, "chunk", chunk)
    monkeypatch.setattr(planner, "fingerprint", fp)


def _rand(n, seed):
    return np.random.default_rng(seed).integers(0, 250, n).tolist()


def test_no_row_crosses_tenants_when_fingerprints_collide(tiny_dir, monkeypatch, tmp_path):
    from irminsul.engine.llm import LLM
    from irminsul.engine.sampling import SamplingParams
    from irminsul.kvcache.store import RowLayout

    tiny_fingerprints(monkeypatch)
    llm = LLM(tiny_dir, reuse="pic", compile_decode=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=1)
    docs = [_rand(400, 200 + i) for i in range(3)]
    for i, doc in enumerate(docs):
        engine.run(engine.add(_rand(30, 210 + i) + doc, params, tenant="alice"))
    crossed = 0
    for i, doc in enumerate(docs):  # the same documents, behind other headers
        seq = engine.add(_rand(50, 220 + i) + doc, params, tenant="bob")
        crossed += seq.stats.reused_tokens + seq.stats.prefix_tokens
        engine.finish(seq)
    assert crossed == 0
    seq = engine.add(_rand(50, 230) + docs[0], params, tenant="alice")
    assert seq.stats.reused_tokens > 100, seq.stats  # alice's own content is still found
    engine.finish(seq)

    # through the disk tier, after a restart: the stored namespace is compared too
    layout = RowLayout.of(llm.model, "tenants")
    store = StoreConfig(("memory", f"disk:{tmp_path}"))

    def fresh():
        from irminsul.engine.build import build_engine
        from irminsul.engine.config import EngineConfig

        registry = open_registry(store, layout, memory_bytes=2**24)
        config = EngineConfig.of(reuse="pic", kv_cache_gib=2**24 / 2**30, compile_decode=False, model_id="tenants")
        return build_engine(config, llm.model, llm.tokenizer, registry=registry), registry

    engine, registry = fresh()
    for i, doc in enumerate(docs):
        engine.run(engine.add(_rand(30, 240 + i) + doc, params, tenant="alice"))
    registry.close()
    engine, registry = fresh()
    for i, doc in enumerate(docs):
        seq = engine.add(_rand(50, 250 + i) + doc, params, tenant="bob")
        assert seq.stats.reused_tokens == 0, seq.stats
        engine.finish(seq)
    seq = engine.add(_rand(50, 260) + docs[1], params, tenant="alice")
    assert seq.stats.reused_tokens > 100, seq.stats
    engine.finish(seq)
    registry.close()


def test_a_scoped_registry_stamps_its_writes():
    shared = MemoryRegistry(10**6)
    ScopedRegistry(shared, ALICE).put(dataclasses.replace(entry(3, ""), namespace="forged"))
    assert shared.peek(3).namespace == ALICE


def test_exact_prefixes_stay_apart_when_the_namespace_seeds_collide(tiny_dir, monkeypatch):
    """The radix tree's tenant salt comes from the BLAKE2b namespace digest: a tenant that finds a
    cache_salt whose 64-bit xxHash seed equals another tenant's (forced here: every seed is one
    value) still matches none of that tenant's prefixes."""
    from irminsul.engine.llm import LLM
    from irminsul.engine.sampling import SamplingParams
    from irminsul.kvcache import namespaces

    monkeypatch.setattr(namespaces, "namespace_seed", lambda model_id, tenant="": 0x5EED)
    engine = LLM(tiny_dir, reuse="prefix", compile_decode=False).engine
    params = SamplingParams(max_tokens=1)
    prompt = _rand(300, 300)
    engine.run(engine.add(prompt, params, tenant="alice"))
    seq = engine.add(prompt, params, tenant="bob")
    assert seq.stats.prefix_tokens == 0, seq.stats
    engine.finish(seq)
    seq = engine.add(prompt, params, tenant="alice")
    assert seq.stats.prefix_tokens >= 290, seq.stats  # alice's own prefix is still found
    engine.finish(seq)
