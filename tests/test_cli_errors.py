"""Bad command-line arguments, unreachable servers, missing folders and a port in use end in one line
on stderr and exit status 2, never a traceback."""

import os
import subprocess
import sys

import pytest

from irminsul.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "quality", "--n", "0"], "--n: 0 must be >= 1"),
        (["demo", "--repeats", "0"], "--repeats: 0 must be >= 1"),
        (["demo", "--doc-chars", "-1"], "--doc-chars: -1 must be >= 1"),
        (["demo", "--threads", "0"], "--threads: 0 must be >= 1"),
        (["eval-reference", "--threads", "0"], "--threads: 0 must be >= 1"),
    ],
)
def test_argument_types(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train-reference", "--tiny", "--phases", "garbage"], "--phases: 'garbage' is not LENGTHxBATCH:SHARE"),
        (["train-reference", "--tiny", "--mix", "foo=2"], "--mix: 'foo=2' is not TASK=SHARE"),
    ],
)
def test_training_options_are_checked_before_training(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--api-key", "@/nonexistent/keys"], "cannot read /nonexistent/keys"),
        (["--store", "disk:{file}"], "cannot use"),
        (["--store", "disk:{dir}", "--disk-budget", "0"], "--disk-budget 0 holds nothing"),
        (["--device", "tpu"], "device='tpu' is not a device"),
        (["--tenant-cache-share", "1.5"], "--tenant-cache-share must be in (0, 1]"),
    ],
)
def test_serve_refuses_what_it_cannot_use(tmp_path, args, message):
    """In a subprocess, with a timeout: if a check were lost, the server would start and serve."""
    (tmp_path / "file").write_text("")
    args = [a.format(file=tmp_path / "file", dir=tmp_path / "store") for a in args]
    env = dict(os.environ, IRMINSUL_COMPILE_DECODE="0")
    run = subprocess.run(
        [sys.executable, "-m", "irminsul.cli", "serve", "--port", "0", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_commands_that_cannot_reach_or_write_say_so_in_one_line(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    assert main(["workloads", "build", "agent_meta", "--source", "tau_bench", "--n", "1", "--out", str(trace)]) == 0
    capsys.readouterr()
    for argv, message in (
        (["bench", "serve", str(trace), "--url", "http://127.0.0.1:1"], "--url http://127.0.0.1:1: no server answers"),
        (
            ["workloads", "build", "agent_meta", "--source", "tau_bench", "--out", str(tmp_path / "no" / "x.jsonl")],
            "the folder",
        ),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_serve_finds_a_port_in_use_before_loading_the_model():
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = dict(os.environ, IRMINSUL_COMPILE_DECODE="0")
        run = subprocess.run(
            [sys.executable, "-m", "irminsul.cli", "serve", "--port", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 2 and f"--port {port}: cannot listen" in run.stderr, run.stderr
    assert "loading" not in run.stderr.lower() and "Traceback" not in run.stderr
