"""`irminsul checkpoint random`: a checkpoint of every family, at sizes beyond the tiny ones, that
LLM() loads and generates from; impossible sizes and bad options are one line and exit status 2;
the commands docs/models.md prints run as printed."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from irminsul import LLM
from irminsul.cli import build_parser, main
from irminsul.model.registry import FAMILIES

ROOT = Path(__file__).resolve().parents[2]


def _generates(path: Path) -> None:
    out = LLM(path, compile_decode=False).generate("hello", max_tokens=2, ignore_eos=True)
    assert len(out.token_ids) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_at_its_own_size_loads_and_generates(tmp_path, capsys, family):
    mla = [] if family == "deepseek_v4" else ["--kv-lora-rank", "48"]
    out = tmp_path / family
    assert (
        main(
            [
                "checkpoint",
                "random",
                str(out),
                "--family",
                family,
                "--layers",
                "5",
                "--hidden",
                "96",
                "--heads",
                "6",
                "--experts",
                "8",
                "--vocab",
                "400",
                "--context",
                "8192",
                *mla,
            ]
        )
        == 0
    )
    assert f"wrote {out}: {family}" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family and config["hidden_size"] == 96 and config["vocab_size"] == 400
    assert config["n_routed_experts"] == 8 and config["max_position_embeddings"] == 8192
    assert config.get("num_layers", config["num_hidden_layers"]) == 5
    assert mla == [] or config["kv_lora_rank"] == 48
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    _generates(out)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v4"])
def test_bfloat16_shards(tmp_path, family):
    from safetensors import safe_open

    out = tmp_path / family
    assert main(["checkpoint", "random", str(out), "--family", family, "--dtype", "bfloat16", "--shards", "2"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2 and sorted(p.name for p in out.glob("*.safetensors")) == files
    with safe_open(str(out / files[0]), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} <= {"BF16", "I64"}
    _generates(out)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--family", "deepseek_v3", "--experts", "3"],
            "deepseek_v3 cannot have these sizes: n_routed_experts=3 is not divisible by n_group=2",
        ),
        (["--family", "deepseek_v3", "--experts", "2"], "leaves fewer than the 2 experts each token is routed to"),
        (["--family", "deepseek_v2", "--experts", "1"], "num_experts_per_tok=2 exceeds n_routed_experts=1"),
        (["--family", "deepseek_v4", "--experts", "1"], "fewer than the 2 experts each token is routed to"),
        (["--family", "deepseek_v2", "--vocab", "100"], "--vocab 100: the byte-level tokenizer needs at least"),
        (["--family", "deepseek_v4", "--kv-lora-rank", "8"], "--kv-lora-rank does not apply to deepseek_v4"),
        (
            ["--family", "deepseek_v3", "--experts", "8", "--experts-per-token", "5"],
            "leaves fewer than the 5 experts each token is routed to",
        ),
        (["--family", "deepseek_v2", "--experts-per-token", "5"], "num_experts_per_tok=5 exceeds n_routed_experts=4"),
        (["--family", "longcat_flash", "--shared-experts", "2"], "--shared-experts does not apply to longcat_flash"),
    ],
)
def test_impossible_sizes_are_one_line(tmp_path, capsys, args, message):
    assert main(["checkpoint", "random", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def test_bad_options_and_an_occupied_directory_exit_2_without_a_traceback(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    for args, message in (
        (["x", "--family", "llama"], "invalid choice: 'llama'"),
        (["x", "--family", "deepseek_v2", "--layers", "0"], "--layers: 0 must be >= 1"),
        (["full", "--family", "deepseek_v2"], "is not an empty directory"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "irminsul", "checkpoint", "random", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


def _page_commands() -> list[str]:
    """The `irminsul` lines of docs/models.md's checkpoint section's fenced blocks."""
    text = (ROOT / "docs" / "models.md").read_text()
    section = text[text.index("## A checkpoint of your own") : text.index("## Refused, with a message")]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_the_checkpoint_pages_commands_run(tmp_path, monkeypatch, capsys):
    """The random checkpoints are made as printed; `irminsul serve --model` parses, and the checkpoint
    it names serves a chat request."""
    from tests.server.server_helpers import chat, start

    commands = _page_commands()
    assert commands and all(c.startswith("irminsul ") for c in commands)
    monkeypatch.chdir(tmp_path)
    made = []
    for command in commands:
        argv = shlex.split(command)[1:]
        if argv[:2] == ["checkpoint", "random"]:
            assert main(argv) == 0, command
            made.append(tmp_path / argv[2])
        else:
            args = build_parser().parse_args(argv)
            assert args.command == "serve", command
    assert len(made) == 2
    for path in made:
        _generates(path)
    server = start(tmp_path / "v3-random")
    try:
        answer = chat(server.url, [{"role": "user", "content": "hi"}], max_tokens=2)
        assert answer["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()


def test_mla_head_sizes_and_v3_scoring(tmp_path):
    """vLLM-loadable MLA widths (kv_lora 512 + rope 64, docs/vllm.md); V3 writes its routing's scoring."""
    out = tmp_path / "v3"
    assert (
        main(
            [
                "checkpoint",
                "random",
                str(out),
                "--family",
                "deepseek_v3",
                "--layers",
                "2",
                "--hidden",
                "64",
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
    config = json.loads((out / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"], config["v_head_dim"]) == (
        512,
        64,
        32,
        32,
    )
    assert config["scoring_func"] == "sigmoid"
    _generates(out)


def test_experts_per_token_and_shared_experts(tmp_path):
    """The routing width and the shared experts are the checkpoint's own (config and weights), as
    DeepSeek-V2-Lite's and Moonlight's top-6 with two shared experts."""
    from safetensors import safe_open

    out = tmp_path / "v3"
    assert (
        main(
            [
                "checkpoint",
                "random",
                str(out),
                "--family",
                "deepseek_v3",
                "--layers",
                "2",
                "--hidden",
                "64",
                "--experts",
                "8",
                "--experts-per-token",
                "3",
                "--shared-experts",
                "2",
            ]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert (config["n_routed_experts"], config["num_experts_per_tok"], config["n_shared_experts"]) == (8, 3, 2)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shape = f.get_slice("model.layers.1.mlp.shared_experts.gate_proj.weight").get_shape()
    assert shape == [2 * config["moe_intermediate_size"], 64]
    _generates(out)
    longcat = tmp_path / "longcat"
    assert main(["checkpoint", "random", str(longcat), "--family", "longcat_flash", "--experts-per-token", "3"]) == 0
    assert json.loads((longcat / "config.json").read_text())["moe_topk"] == 3
