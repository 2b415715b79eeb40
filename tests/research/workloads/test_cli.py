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
    with pytest.raises(SystemExit) as e:  # (argparse's usage error: --n counts sessions)
        main([*argv, "--n", "0"])
    assert e.value.code == 2 and "--n: 0 must be >= 1" in capsys.readouterr().err and not out.exists()
    assert main([*argv, "--max-prompt-tokens", "10"]) == 2  # every session cut before its first turn
    assert "built no requests" in capsys.readouterr().err and not out.exists()


def test_unknown_strategy_is_refused_before_rendering(trace, capsys, monkeypatch):
    import irminsul.research.workloads.render as render

    monkeypatch.setattr(render.Renderer, "__call__", lambda *a: pytest.fail("rendered before refusing"))
    assert main(["bench", "recovery", str(trace), "--strategies", "cdc", "bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_plots_say_where_they_went(trace, capsys, tmp_path):
    assert main(["census", str(trace), "--plot", str(tmp_path / "c.png")]) == 0
    assert f"wrote {tmp_path / 'c.png'}" in capsys.readouterr().err


def test_build_can_cut_sessions_to_a_context(tmp_path, capsys):
    """--max-prompt-tokens keeps each session up to its first prompt over the limit: a trace a small
    model serves whole (every tau-bench/MuSiQue/BFCL trace uncut overflows the bundled model's context)."""
    from irminsul.research.workloads.render import render_trace
    from irminsul.research.workloads.trace import read_trace

    full, cut = tmp_path / "full.jsonl", tmp_path / "cut.jsonl"
    assert main(["workloads", "build", "raw", "--source", "toolbench", "--n", "10", "--out", str(full)]) == 0
    assert (
        main(
            [
                "workloads",
                "build",
                "raw",
                "--source",
                "toolbench",
                "--n",
                "10",
                "--out",
                str(cut),
                "--max-prompt-tokens",
                "1800",
            ]
        )
        == 0
    )
    assert "sessions cut at their first prompt over 1800 tokens" in capsys.readouterr().out
    whole, kept = read_trace(full), read_trace(cut)
    lengths = {id(r): len(x.token_ids) for r, (_, x) in zip(whole, render_trace(whole, "deepseek"))}
    assert 0 < len(kept) < len(whole)
    assert all(len(x.token_ids) <= 1800 for _, x in render_trace(kept, "deepseek"))
    for session in {r.session for r in whole}:  # each session: a prefix of its turns, cut before the first long one
        turns, left = [r for r in whole if r.session == session], [r for r in kept if r.session == session]
        first_long = next((i for i, r in enumerate(turns) if lengths[id(r)] > 1800), len(turns))
        assert [r.to_json() for r in left] == [r.to_json() for r in turns[:first_long]]
