"""vLLM + Irminsul with store tiers, for real (vLLM 0.32 CPU, a real disk, a real redis-server): the
connector's `"stores"` option puts Irminsul's disk and Redis tiers under its registry, so a vLLM
restarted on the same disk, or a second vLLM on the same Redis, loads the documents the first one
computed; tenants (cache_salt) never load each other's rows through them; and a Redis that hangs
mid-run costs a recompute, never an error.

Each engine runs in its own process (store_driver.py), under a timeout, on a one-layer checkpoint.
A new process finds a document in the tiers chunk by chunk, by fingerprint: the chunk where it begins
(the old header's end and the document's start) is found only in memory, through the S1 windows, so
what a restarted engine loads is the document after its first content-defined cut. The documents here
are the random ones whose first cut comes early (most of their rows after it), as most do.
Skipped when vLLM is not installed (see tests/integrations/__init__.py).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations import require_vllm

require_vllm()

from irminsul.cli import main as irminsul_main  # noqa: E402
from tests.integrations.store_driver import DOC  # noqa: E402
from tests.support.services import RedisProcess  # noqa: E402

TIMEOUT = 600  # seconds per engine process
ROOT = Path(__file__).resolve().parents[2]  # the processes run `python -m` from the clone's root (tests.support)
# a Redis command's deadline: a shared test machine may stall a process longer than the default
SLOW_BOX = 2.0
MOST = int(0.7 * DOC)  # of a document's rows, the least a reusing request loads


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "v3"
    argv = [
        "checkpoint",
        "random",
        str(path),
        "--family",
        "deepseek_v3",
        "--layers",
        "1",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--vocab",
        "512",
        "--kv-lora-rank",
        "512",
        "--rope-head-dim",
        "64",
        "--nope-head-dim",
        "32",
        "--v-head-dim",
        "32",
    ]
    assert irminsul_main(argv) == 0
    return path


@pytest.fixture
def redis_proc():
    proc = RedisProcess()  # fails (never skips) when redis-server is missing
    yield proc
    if proc.proc is not None and proc.proc.poll() is None:
        os.kill(proc.proc.pid, signal.SIGCONT)  # (a test may have paused it)
    proc.stop()


def _engine(path, extra: dict, requests: list[dict], pause: dict | None = None) -> dict:
    job = {"extra": extra, "requests": requests, **({"pause": pause} if pause else {})}
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "IRMINSUL_STORE_SECRET": "test-secret",
    }
    p = subprocess.run(
        [sys.executable, "-m", "tests.integrations.store_driver", str(path), json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        cwd=ROOT,
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert p.returncode == 0 and line is not None, p.stderr[-3000:]
    return json.loads(line[len("RESULT ") :])


def _tier(result: dict, name: str) -> dict:
    return next(t for t in result["tiers"] if t["tier"] == name)


def _loaded_from_the_tier(request: dict) -> None:
    """The request loaded most of its document, every loaded row brought in from a lower tier."""
    assert request["loaded_tokens"] >= MOST, request
    assert request["fetched_tokens"] >= request["loaded_tokens"], request
    assert request["loaded_tokens"] + request["computed_prompt_tokens"] == request["prompt_tokens"], request


def test_a_restarted_vllm_loads_its_documents_from_the_disk(one_layer, tmp_path):
    """An engine with a disk store serves a document and shuts down; a new engine process on the same disk
    answers the document moved behind a header never seen before with its rows loaded from the disk tier,
    and gives the answer of the document computed whole (asked under a cache_salt of its own, whose
    namespace holds nothing: on one layer reuse is exact)."""
    extra = {"stores": [f"disk:{tmp_path / 'store'}"]}
    first = _engine(one_layer, extra, [{"doc": 0, "header": 0}, {"doc": 0, "header": 9, "salt": "alone"}])
    computed = first["requests"][1]
    assert first["requests"][0]["loaded_tokens"] == 0 and computed["loaded_tokens"] == 0
    disk = _tier(first, "disk")
    assert disk["insertions"] > 0 and disk["pending"] == 0 and disk["failures"] == 0, disk

    again = _engine(one_layer, extra, [{"doc": 0, "header": 9}])
    moved = again["requests"][0]
    _loaded_from_the_tier(moved)
    assert _tier(again, "disk")["hits"] > 0 and _tier(again, "disk")["corrupt"] == 0
    assert again["worker"]["fetched_rows"] >= moved["loaded_tokens"] and again["worker"]["missed_rows"] == 0
    assert moved["token_ids"] == computed["token_ids"]
    assert moved["logprobs"] == pytest.approx(computed["logprobs"], abs=0.15)


def test_two_vllms_share_one_redis(one_layer, redis_proc):
    """A second engine (another process, no disk) loads from Redis the rows the first engine computed."""
    extra = {"stores": [redis_proc.url], "redis_timeout_s": SLOW_BOX}
    first = _engine(one_layer, extra, [{"doc": 2, "header": 0}])
    assert _tier(first, "redis")["failures"] == 0
    assert any(k.startswith(b"irminsul:") for k in redis_proc.client().keys())
    second = _engine(one_layer, extra, [{"doc": 2, "header": 3}])
    _loaded_from_the_tier(second["requests"][0])
    assert _tier(second, "redis")["hits"] > 0 and _tier(second, "redis")["corrupt"] == 0


def test_tenants_never_load_each_others_rows_from_the_store(one_layer, tmp_path, redis_proc):
    """A document saved under one cache_salt, on a disk and a Redis both engines share: a new engine loads
    none of it under another salt or under none, and most of it under the same salt."""
    extra = {"stores": [f"disk:{tmp_path / 'store'}", redis_proc.url], "redis_timeout_s": SLOW_BOX}
    _engine(one_layer, extra, [{"doc": 3, "header": 0, "salt": "a"}])
    asked = _engine(
        one_layer,
        extra,
        [{"doc": 3, "header": 4, "salt": "b"}, {"doc": 3, "header": 5}, {"doc": 3, "header": 6, "salt": "a"}],
    )["requests"]
    for other in asked[:2]:
        assert other["loaded_tokens"] == 0 and other["fetched_tokens"] == 0, other
    _loaded_from_the_tier(asked[2])


def test_a_redis_that_hangs_mid_run_costs_a_recompute(one_layer, redis_proc):
    """Redis stops answering (SIGSTOP) between two requests of an engine that was loading from it: the
    next document's rows are computed, not loaded, every request completes, and the engine goes on
    (the same document again is loaded from memory)."""
    extra = {"stores": [redis_proc.url], "redis_timeout_s": SLOW_BOX}
    _engine(one_layer, extra, [{"doc": 5, "header": 0}, {"doc": 6, "header": 0}])
    requests = [{"doc": 5, "header": 2}, {"doc": 6, "header": 2}, {"doc": 6, "header": 5}]
    result = _engine(one_layer, extra, requests, pause={"before": 1, "pid": redis_proc.proc.pid})
    served, hung, after = result["requests"]
    _loaded_from_the_tier(served)  # (Redis up)
    assert hung["loaded_tokens"] == 0 and hung["fetched_tokens"] == 0, hung  # (Redis hung: recomputed)
    assert after["loaded_tokens"] >= MOST and after["fetched_tokens"] == 0, after  # (from memory)
    assert all(len(r["token_ids"]) == 2 for r in result["requests"])
    redis = _tier(result, "redis")
    assert redis["failures"] > 0 and not redis["available"], redis
