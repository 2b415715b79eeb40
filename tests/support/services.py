"""Helpers that start real services on loopback for tests and benchmarks (like sglang.test); test
support, not part of the installed package.

``RedisProcess`` runs a throw-away ``redis-server`` on a free port; ``ServerProcess`` runs
``irminsul serve`` in a subprocess; ``ThreadServer`` runs the app under uvicorn in this process.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM, up to `grace` seconds for it to exit, then SIGKILL (and reap it)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


class RedisProcess:
    """A redis-server with no persistence on 127.0.0.1:port; ``stop``/``start`` simulate an outage.
    ``options`` are more redis-server arguments, e.g. ``("--maxmemory", "2mb")``."""

    def __init__(self, port: int | None = None, options: tuple[str, ...] = ()):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed; the store and server tests need it "
                "(apt-get install -y redis-server, as .ci/run does)"
            )
        self.binary, self.port, self.options = binary, port or free_port(), tuple(options)
        self.dir = tempfile.mkdtemp(prefix="irminsul-redis-")
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                *self.options,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        wait_for(self._ping, 10, f"redis-server on port {self.port}")

    def _ping(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.proc.returncode} (port {self.port} taken?)")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)


def rss_mib(pid: int) -> int:
    """A process's resident memory in MiB (Linux's /proc), -1 where it cannot be read."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    return -1


class ServerProcess:
    """``irminsul serve ARGS`` in a subprocess on a free port; ``url`` is its base URL."""

    def __init__(self, *args: str, port: int | None = None, timeout: float = 120):
        self.port = port or free_port()
        self.log = Path(tempfile.mkstemp(prefix="irminsul-serve-", suffix=".log")[1])
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "irminsul.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        wait_for(self._healthy, timeout, f"irminsul serve on port {self.port}", interval=0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        import httpx

        if self.proc.poll() is not None:
            raise RuntimeError(f"irminsul serve exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        stop_process(self.proc, 15)


class ThreadServer:
    """Serve an ASGI app with uvicorn on a free loopback port in a daemon thread."""

    def __init__(self, app, port: int | None = None, config=None):
        """`config`: the app's ServerConfig; given, uvicorn runs as `irminsul serve` runs it (its
        HTTP protocol with header and body deadlines and the connection cap)."""
        import dataclasses

        import uvicorn

        self.app, self.port = app, port or free_port()
        if config is not None:
            from irminsul.server.cli import uvicorn_config

            settings = uvicorn_config(app, dataclasses.replace(config, host="127.0.0.1", port=self.port), "warning")
        else:
            settings = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(settings)
        self.thread = threading.Thread(target=self.server.run, name="irminsul-uvicorn", daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 60, f"uvicorn on port {self.port}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
