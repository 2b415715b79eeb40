"""How long `irminsul serve` takes from its start to its first answer, cold: every cache empty.

A new model is what a user meets first: the server is started on it with fresh caches (the native
kernels' build, the linear products' measurements, torch.compile's on-disk caches: each pointed at
an empty folder), and the clock runs from the process's start to the end of the first chat
completion (16 tokens). Each decode mode is timed: the default (compiled in the background while
the eager path serves), `--compile-decode` (compiled before serving) and `--no-compile-decode`
(eager only). Then the same request again, once the compiled steps are ready, shows what compiling
buys per request. No --threads: torch's default, the thread count a user gets.

    python benchmarks/bench_startup.py                          # the bundled model and a new random one
    python benchmarks/bench_startup.py --model CHECKPOINT_DIR   # one checkpoint of yours
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from irminsul import bundled_model
from irminsul.cli import run_for_people
from irminsul.machine import describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the clone's root, for tests/support
from tests.support.services import free_port  # noqa: E402

MODES = {"default": [], "--compile-decode": ["--compile-decode"], "--no-compile-decode": ["--no-compile-decode"]}


def _ask(port: int, max_tokens: int = 16) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as r:
        model = json.loads(r.read())["data"][0]["id"]
    body = json.dumps(
        {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Say something about caches."}],
        }
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=1800) as r:
        json.loads(r.read())


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def first_answer(model: Path, flags: list[str], limit: float) -> tuple[float, float, float | None]:
    """(seconds from start to the first answer, seconds of a later answer once any background compile
    is done, seconds from start until it was done or None), with every cache empty."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(
            os.environ,
            IRMINSUL_NATIVE_CACHE=f"{cache}/native",
            IRMINSUL_KERNEL_CACHE=f"{cache}/kernels.json",
            TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor",
            XDG_CACHE_HOME=cache,
        )
        env.pop("IRMINSUL_COMPILE_DECODE", None)
        port = free_port()
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "irminsul", "serve", "--model", str(model), "--port", str(port), *flags],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        log: list[str] = []
        compiled: list[float] = []

        def read():
            for line in proc.stderr:
                log.append(line)
                if "compiled decode steps are ready" in line:
                    compiled.append(time.perf_counter() - start)

        threading.Thread(target=read, daemon=True).start()
        try:
            while not _ready(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited: {''.join(log)[-2000:]}")
                if time.perf_counter() - start > limit:
                    raise RuntimeError(f"no answer within {limit:.0f} s")
                time.sleep(0.2)
            _ask(port)
            first = time.perf_counter() - start
            if not flags:  # the default: wait for the background compile
                while not compiled and proc.poll() is None and time.perf_counter() - start < limit:
                    time.sleep(0.5)
            _ask(port)  # (the prompt's prefix cached now: a later request's time is mostly its decode)
            t = time.perf_counter()
            _ask(port)
            return first, time.perf_counter() - t, compiled[0] if compiled else None
        finally:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default=None,
        help="a checkpoint directory (default: the bundled model and a random DeepSeek-V3 made here)",
    )
    ap.add_argument("--limit", type=float, default=1800, help="give up on a start after this many seconds")
    args = ap.parse_args()
    print(f"machine: {describe()}\n")
    with tempfile.TemporaryDirectory() as tmp:
        models = {"given": Path(args.model)} if args.model else {"bundled": bundled_model("mla")}
        if not args.model:
            new = Path(tmp) / "random-v3"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "irminsul",
                    "checkpoint",
                    "random",
                    str(new),
                    "--family",
                    "deepseek_v3",
                    "--layers",
                    "2",
                    "--hidden",
                    "256",
                    "--vocab",
                    "4096",
                ],
                check=True,
                capture_output=True,
            )
            models["new random V3"] = new
        print(f"{'model':14} {'mode':20} {'first answer s':>15} {'compiled at s':>14} {'a later answer ms':>18}")
        for name, model in models.items():
            for mode, flags in MODES.items():
                first, later, at = first_answer(model, flags, args.limit)
                done = f"{at:14.1f}" if at is not None else f"{'-':>14}"
                print(f"{name:14} {mode:20} {first:15.1f} {done} {1000 * later:18.0f}", flush=True)


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
