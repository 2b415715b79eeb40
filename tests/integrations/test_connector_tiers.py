"""The connector's store tiers without a model: test_connector.py's MiniEngine (the connector's two
sides driven as vLLM drives them, every request's rows checked against the true ones) over Irminsul's
disk and Redis tiers (a real directory, a real redis-server). A second MiniEngine on the same store is
a restarted vLLM or another replica. Seconds; needs vLLM installed (the connector's base class).
"""

import numpy as np
import pytest
import torch

from tests.integrations import require_vllm

require_vllm()

from irminsul.integrations.vllm import connector  # noqa: E402
from tests.integrations.test_connector import MiniEngine, _ids, _registry_gib  # noqa: E402
from tests.support.services import RedisProcess, free_port  # noqa: E402

SLOW_BOX = 2.0  # a Redis command's deadline: a shared test machine may stall a process longer than the default


@pytest.fixture(autouse=True)
def _fake_engine_dtype(monkeypatch):
    # the MiniEngine's config is not a vLLM one: its cache holds float32 rows
    monkeypatch.setattr(connector, "_cache_dtype", lambda vllm_config: torch.float32)
    monkeypatch.setenv("IRMINSUL_STORE_SECRET", "test-secret")


@pytest.fixture
def redis_proc():
    proc = RedisProcess()  # fails (never skips) when redis-server is missing
    yield proc
    proc.stop()


def _stop(engine: MiniEngine) -> None:
    """vLLM's shutdown of the engine: the connector writes down what it queued for the tiers."""
    engine.sched.shutdown()


def _tier(engine: MiniEngine, name: str):
    return next(t for t in engine.sched.index.registry.all_tier_stats if t.tier == name)


def test_a_restarted_engine_loads_the_true_rows_from_the_disk(tmp_path):
    """Rows saved by one engine are written to the disk; a new engine on the same disk plans the document
    behind a new header from them, and every row it loads is the true one (k_pe rotated from the stored
    positions to the new ones)."""
    extra = {"stores": [f"disk:{tmp_path / 'store'}"]}
    rng = np.random.default_rng(0)
    doc = _ids(rng, 600)
    first = MiniEngine(tmp_path, **extra)
    first.run(_ids(rng, 40) + doc)
    _stop(first)
    assert _tier(first, "disk").insertions > 0 and _tier(first, "disk").pending == 0

    again = MiniEngine(tmp_path, **extra)
    stats = again.run(_ids(rng, 75) + doc)  # (MiniEngine.serve checks every row)
    assert stats.loaded_tokens >= 400 and stats.fetched_tokens >= stats.loaded_tokens
    assert again.worker.fetched_rows == stats.fetched_tokens and again.worker.missed_rows == 0
    assert _tier(again, "disk").hits > 0 and again.keys_agree()
    # once in memory, the next request loads it from there
    assert again.run(_ids(rng, 60) + doc).fetched_tokens == 0


def test_a_registry_smaller_than_a_document_spills_and_brings_back(tmp_path):
    """Documents cycling through a registry of 400 rows over a disk tier: chunks evicted from memory are
    brought back from the disk (under new keys, their rows handed to the worker), evicted again, and every
    load lands the true rows; the worker holds the rows of exactly the registry's entries."""
    engine = MiniEngine(tmp_path, registry_gib=_registry_gib(400), stores=[f"disk:{tmp_path / 'store'}"])
    rng = np.random.default_rng(1)
    docs = [_ids(rng, 600) for _ in range(3)]
    stats = engine.serve([(_ids(rng, 40 + i % 7) + docs[i // 2 % 3] + _ids(rng, 8), None) for i in range(24)])
    assert len(stats) == 24 and engine.recomputed == 0 and engine.worker.missed_rows == 0
    # (three requests at a time pin most of the 400 rows: what comes back is what fits beside them)
    assert sum(x.fetched_tokens for x in stats) > 300 and sum(x.loaded_tokens for x in stats) > 2000
    assert engine.keys_agree()
    _stop(engine)


def test_two_engines_share_one_redis(tmp_path, redis_proc):
    rng = np.random.default_rng(2)
    doc = _ids(rng, 600)
    first = MiniEngine(tmp_path, stores=[redis_proc.url], redis_timeout_s=SLOW_BOX)
    first.run(_ids(rng, 40) + doc)
    _stop(first)
    second = MiniEngine(tmp_path, stores=redis_proc.url, redis_timeout_s=SLOW_BOX)  # (one spec as a string)
    stats = second.run(_ids(rng, 75) + doc)
    assert stats.loaded_tokens >= 400 and stats.fetched_tokens >= stats.loaded_tokens
    assert _tier(second, "redis").hits > 0 and _tier(second, "redis").corrupt == 0
    _stop(second)


def test_tenants_never_load_each_others_rows_from_the_tiers(tmp_path, redis_proc):
    """Chunks saved under one cache_salt, on a disk and a Redis: a new engine loads none of them under
    another salt or under none (nothing even brought into memory), and does under the same salt."""
    stores = [f"disk:{tmp_path / 'store'}", redis_proc.url]
    rng = np.random.default_rng(3)
    doc = _ids(rng, 600)
    first = MiniEngine(tmp_path, stores=stores, redis_timeout_s=SLOW_BOX)
    first.run(_ids(rng, 40) + doc, salt="a")
    _stop(first)
    again = MiniEngine(tmp_path, stores=stores, redis_timeout_s=SLOW_BOX)
    for salt in ("b", None):
        stats = again.run(_ids(rng, 75) + doc, salt=salt)
        assert stats.loaded_tokens == 0 and stats.fetched_tokens == 0, salt
    assert again.run(_ids(rng, 75) + doc, salt="a").loaded_tokens >= 400
    _stop(again)


def test_another_store_secret_reads_nothing(tmp_path, monkeypatch):
    """Entries are keyed by the store secret's id: an engine under another secret finds none of them."""
    extra = {"stores": [f"disk:{tmp_path / 'store'}"]}
    rng = np.random.default_rng(4)
    doc = _ids(rng, 600)
    first = MiniEngine(tmp_path, **extra)
    first.run(_ids(rng, 40) + doc)
    _stop(first)
    monkeypatch.setenv("IRMINSUL_STORE_SECRET", "another-secret")
    other = MiniEngine(tmp_path, **extra)
    assert other.run(_ids(rng, 75) + doc).fetched_tokens == 0


def test_damaged_entries_are_dropped_and_recomputed(tmp_path):
    """Bytes flipped in every entry on the disk: the MAC fails, the entries are dropped (counted), the
    document is computed (its rows true), and no error reaches the engine."""
    store = tmp_path / "store"
    rng = np.random.default_rng(5)
    doc = _ids(rng, 600)
    first = MiniEngine(tmp_path, stores=[f"disk:{store}"])
    first.run(_ids(rng, 40) + doc)
    _stop(first)
    files = list(store.rglob("*.safetensors"))
    assert files
    for f in files:
        blob = bytearray(f.read_bytes())
        blob[-5] ^= 0xFF
        f.write_bytes(bytes(blob))
    again = MiniEngine(tmp_path, stores=[f"disk:{store}"])
    stats = again.run(_ids(rng, 75) + doc)
    assert stats.loaded_tokens == 0 and stats.fetched_tokens == 0
    assert _tier(again, "disk").corrupt > 0


def test_a_redis_that_does_not_answer_is_a_miss(tmp_path):
    """Nothing listens at the Redis address: every request is served (computed, its rows true), writes
    are skipped, and a disk tier beside it still serves."""
    stores = [f"disk:{tmp_path / 'store'}", f"redis://127.0.0.1:{free_port()}/0"]
    rng = np.random.default_rng(6)
    doc = _ids(rng, 600)
    first = MiniEngine(tmp_path, stores=stores, redis_timeout_s=SLOW_BOX)
    first.run(_ids(rng, 40) + doc)
    assert not _tier(first, "redis").available
    _stop(first)
    again = MiniEngine(tmp_path, stores=stores, redis_timeout_s=SLOW_BOX)
    assert again.run(_ids(rng, 75) + doc).fetched_tokens >= 400  # (from the disk)
    _stop(again)
