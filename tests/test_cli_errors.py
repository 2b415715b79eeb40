"""Bad command-line arguments end in one line on stderr and exit status 2, never a traceback (each of
these once crashed, found by probing the CLI)."""

import os
import subprocess
import sys

import pytest

from irminsul.cli import main


@pytest.mark.parametrize("argv, message", [
    (["eval", "quality", "--n", "0"], "--n: 0 must be >= 1"),
    (["demo", "--repeats", "0"], "--repeats: 0 must be >= 1"),
    (["demo", "--doc-chars", "-1"], "--doc-chars: -1 must be >= 1"),
])
def test_argument_types(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["train-reference", "--tiny", "--phases", "garbage"], "--phases: 'garbage' is not LENGTHxBATCH:SHARE"),
    (["train-reference", "--tiny", "--mix", "foo=2"], "--mix: 'foo=2' is not TASK=SHARE"),
])
def test_training_options_are_checked_before_training(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--api-key", "@/nonexistent/keys"], "cannot read /nonexistent/keys"),
    (["--store", "disk:{file}"], "cannot use"),
    (["--store", "disk:{dir}", "--disk-budget", "0"], "--disk-budget 0 holds nothing"),
    (["--device", "tpu"], "device='tpu' is not a device"),
    (["--tenant-cache-share", "1.5"], "--tenant-cache-share must be in (0, 1]"),
])
def test_serve_refuses_what_it_cannot_use(tmp_path, args, message):
    """In a subprocess, with a timeout: if a check were lost, the server would start and serve."""
    (tmp_path / "file").write_text("")
    args = [a.format(file=tmp_path / "file", dir=tmp_path / "store") for a in args]
    env = dict(os.environ, IRMINSUL_COMPILE_DECODE="0")
    run = subprocess.run([sys.executable, "-m", "irminsul.cli", "serve", "--port", "0", *args], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr
