"""The command line says what it is, which version it is, and what its options default to."""

import importlib.metadata
import os
import subprocess
import sys

import pytest

from irminsul.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"irminsul {importlib.metadata.version('irminsul')}"


def test_python_dash_m():
    done = subprocess.run(
        [sys.executable, "-m", "irminsul", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: irminsul") and "LLM serving engine" in done.stdout


def test_help_and_version_do_not_load_torch():
    """Every option's help, and the version, without importing torch (seconds on a busy machine): a
    mistyped flag is answered at once."""
    code = (
        "import sys\nfrom irminsul.cli import build_parser\nparser = build_parser()\n"
        "for name in ('serve', 'demo', 'checkpoint', 'vllm-serve', 'bench'):\n"
        "    try:\n        parser.parse_args([name, '--help'])\n    except SystemExit:\n        pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_option_says_what_it_does():
    """No option of any subcommand is left without help text."""
    import argparse

    from irminsul.cli import build_parser

    missing = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif action.help is None and not isinstance(action, argparse._HelpAction):
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "irminsul")
    assert missing == []


def test_serve_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # (argparse wraps lines)
    assert "port to listen on (default: 8000)" in out and "(default: pic)" in out
    assert "(default: None)" not in out  # an option without a default says what happens instead


def test_demo_sizes_its_warm_up_starts_empty_and_explains_its_columns(capsys):
    """A longer document than the default fits (the warm-up is the measured prompts' size); the
    first request of each mode finds nothing in the cache; every column is explained under the table."""
    assert main(["demo", "--doc-chars", "4000", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    header, rows = cells[0], [r for r in cells if r[0] in ("prefix", "pic")]
    assert len(rows) == 4
    for row in rows:
        cells = dict(zip(header, row))
        computed, prompt = map(int, cells["computed / prompt"].split(" / "))
        assert int(cells["prefix rows"]) + int(cells["reused rows"]) + computed == prompt
        if cells["request"] == "1":
            assert cells["prefix rows"] == cells["reused rows"] == cells["carve-out"] == "0" and computed == prompt
    pic_2 = dict(zip(header, rows[3]))
    assert int(pic_2["reused rows"]) > 0
    for column in set(header) - {"mode", "request", "answer"}:  # (those name themselves)
        assert any(line.startswith(column + " ") for line in out.splitlines()), column
