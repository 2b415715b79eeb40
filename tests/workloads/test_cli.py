import json

import pytest

from irminsul.cli import main


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
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


def test_no_data_is_an_error_not_an_empty_trace(tmp_path, capsys):
    """A data folder without the source's files fails with one line naming the file, writing nothing."""
    out = tmp_path / "x.jsonl"
    (tmp_path / "empty").mkdir()
    argv = ["workloads", "build", "agent_meta", "--source", "toolbench", "--out", str(out)]
    assert main([*argv, "--data", str(tmp_path / "empty")]) == 2
    assert "missing data file" in capsys.readouterr().err and not out.exists()
    assert main([*argv, "--data", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err and not out.exists()
    assert main([*argv, "--n", "0"]) == 2
    assert "built no requests" in capsys.readouterr().err and not out.exists()


def test_unknown_strategy_is_refused_before_rendering(trace, capsys, monkeypatch):
    import irminsul.workloads.render as render

    monkeypatch.setattr(render.Renderer, "__call__", lambda *a: pytest.fail("rendered before refusing"))
    assert main(["bench", "recovery", str(trace), "--strategies", "cdc", "bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_plots_say_where_they_went(trace, capsys, tmp_path):
    assert main(["census", str(trace), "--plot", str(tmp_path / "c.png")]) == 0
    assert f"wrote {tmp_path / 'c.png'}" in capsys.readouterr().err
