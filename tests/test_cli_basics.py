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
    done = subprocess.run([sys.executable, "-m", "irminsul", "--help"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: irminsul") and "LLM serving engine" in done.stdout


def test_serve_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # (argparse wraps lines)
    assert "port to listen on (default: 8000)" in out and "(default: pic)" in out
    assert "(default: None)" not in out  # an option without a default says what happens instead
