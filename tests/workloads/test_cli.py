import json

import pytest

from irminsul.cli import main
from irminsul.workloads.tokenizers import DATA_DIR


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    if not DATA_DIR.exists():
        pytest.skip("the shared data directory is absent")
    out = tmp_path_factory.mktemp("wl") / "agent_meta.jsonl"
    assert main(["workloads", "build", "agent_meta", "--source", "toolbench", "--out", str(out), "--n", "3"]) == 0
    return out


def test_census_json_and_plot(trace, capsys, tmp_path):
    capsys.readouterr()
    assert main(["census", str(trace), "--json", "--plot", str(tmp_path / "c.png")]) == 0
    j = json.loads(capsys.readouterr().out)
    for key in ("prompt_tokens", "prefix_tokens", "shifted_tokens", "novel_tokens", "oracle_tokens"):
        assert isinstance(j[key], int)
    assert j["prefix_tokens"] + j["shifted_tokens"] + j["novel_tokens"] == j["prompt_tokens"]
    assert j["within_session"]["shifted_tokens"] + j["cross_session"]["shifted_tokens"] == j["shifted_tokens"]
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_census_table_with_qwen2(trace, capsys):
    assert main(["census", str(trace), "--tokenizer", "qwen2"]) == 0
    out = capsys.readouterr().out
    assert "| prefix" in out and "| novel" in out


def test_bench_recovery_json(trace, capsys, tmp_path):
    capsys.readouterr()
    assert main(["bench", "recovery", str(trace), "--json", "--plot", str(tmp_path / "r.png")]) == 0
    j = json.loads(capsys.readouterr().out)
    assert {"prompt_tokens", "prefix_tokens", "oracle_tokens", "strategies"} <= set(j)
    assert set(j["strategies"]) == {"prefix", "fixed128", "cdc", "cdc+s1", "cdc+s2"}
    assert all("recovered_tokens" in s for s in j["strategies"].values())
    assert (tmp_path / "r.png").exists()


def test_errors_are_for_people(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session": "a", "token_ids": [1]}\n{"session": "a", "messages": "hi"}\n')
    assert main(["census", str(bad)]) == 2
    assert "bad.jsonl:2:" in capsys.readouterr().err
    assert main(["census", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["workloads", "build", "rerank", "--source", "toolbench", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "rerank needs" in capsys.readouterr().err
