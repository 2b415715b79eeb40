"""Preemption and aborts of requests with loaded rows, in vLLM for real, on a one-layer checkpoint (where
reuse is exact: a loaded row equals the computed one, so vLLM + Irminsul may differ from vLLM alone only
by vLLM's own numerical noise). The KV cache is made too small for the batch (`num_gpu_blocks_override`),
so vLLM preempts requests that loaded rows and resumes them; two requests are aborted, one while decoding
after its loads, one before it ran. Each engine in its own process (preempt_driver.py)."""

import json
import os
import subprocess
import sys

import pytest

from tests.integrations import require_vllm

require_vllm()

from tests.integrations.test_vllm import ROOT, TIMEOUT, _checkpoint  # noqa: E402

BLOCKS = 120  # 16-token blocks: room for about two and a half of the batch's 680-token prompts


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("ck") / "v3", 1)


def _drive(path, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    p = subprocess.run(
        [sys.executable, "-m", "tests.integrations.preempt_driver", str(path), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        cwd=ROOT,
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, p.stderr[-3000:]
    return json.loads(line[len("RESULT ") :])


def _distance(decoded, scored) -> float:
    """Max |difference| of the log-probabilities a decode gave and those a prefill over the same tokens
    gives (the tokens both list)."""
    return max(abs(decoded[i][t] - scored[i][t]) for i in range(len(decoded)) for t in decoded[i] if t in scored[i])


def test_preempted_and_aborted_requests_with_loaded_rows(one_layer, tmp_path):
    irm = _drive(one_layer, "irminsul", str(BLOCKS))
    stats = irm["stats"]
    # vLLM preempted requests that had loaded rows, resumed them, and they loaded their rows again
    resumed = [n for n in irm["preempted"] if n.startswith("keep")]
    assert resumed and all(stats[n]["preemptions"] >= 1 and stats[n]["loaded_tokens"] >= 400 for n in resumed), irm
    assert stats["abort_decoding"]["loaded_tokens"] >= 400 and irm["aborted"] == ["abort_decoding", "abort_early"]
    # nothing left in flight: no plan, pending load or pinned registry entry of any request, the aborted
    # ones included; the worker holds exactly the registry's rows and missed none
    assert set(irm["in_flight"].values()) == {0}, irm["in_flight"]
    assert irm["worker"]["missed_rows"] == 0 and irm["worker"]["rows_match_registry"]
    # vLLM alone, same batch and cache, scores Irminsul's continuations token by token (one prefill each),
    # and its own two decodes of each request (in the batch, and on its own)
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps(irm["outputs"]))
    alone = _drive(one_layer, "alone", str(BLOCKS), str(outputs))
    for name, out in irm["outputs"].items():
        assert len(out["token_ids"]) == 24
        noise = max(
            _distance(alone["outputs"][name]["logprobs"], alone["scored"]["self"][name]),
            _distance(alone["single"][name]["logprobs"], alone["scored"]["single"][name]),
        )
        assert _distance(out["logprobs"], alone["scored"]["given"][name]) <= max(0.15, 1.25 * noise), name
