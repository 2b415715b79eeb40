"""`irminsul serve --store redis://127.0.0.1:PORT/0 --start-redis`: the shared tier, started with the server.

One server or a fleet (`--replicas N`) alike.

A `redis-server` on the `--store` address (a loopback host only: a Redis for other hosts is the
operator's to run), with no persistence (the tier is a cache: every entry can be computed again)
and a memory cap with LRU eviction, so a full store drops its oldest chunks instead of refusing
writes. It is stopped when the server or the fleet stops.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from urllib.parse import urlparse

from irminsul.errors import UserFacingError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class LocalRedis:
    def __init__(self, url: str, max_memory: str = "2gb", timeout_s: float = 10.0):
        parsed = urlparse(url)
        if parsed.scheme != "redis":
            raise UserFacingError(f"--start-redis needs a redis:// --store address, not {url!r}")
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
        if host not in LOOPBACK:
            raise UserFacingError(
                f"--start-redis starts a Redis on this host only: {host} is not a loopback "
                "address (run Redis there yourself, and drop --start-redis)"
            )
        binary = shutil.which("redis-server")
        if binary is None:
            raise UserFacingError(
                "--start-redis: redis-server is not installed (apt-get install redis-server, "
                "or run Redis yourself and drop --start-redis)"
            )
        if _answers(host, port):
            raise UserFacingError(
                f"--start-redis: something already listens on {host}:{port}; use that Redis "
                "(drop --start-redis) or pick another port in --store"
            )
        self.host, self.port = host, port
        self.dir = tempfile.mkdtemp(prefix="irminsul-fleet-redis-")
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                host,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--maxmemory",
                max_memory,
                "--maxmemory-policy",
                "allkeys-lru",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        end = time.monotonic() + timeout_s
        while not _answers(host, port, ping=True):
            if self.proc.poll() is not None:
                raise UserFacingError(
                    f"--start-redis: redis-server exited with {self.proc.returncode} (is {host}:{port} usable?)"
                )
            if time.monotonic() > end:
                self.stop()
                raise UserFacingError(
                    f"--start-redis: redis-server did not answer on {host}:{port} within {timeout_s:.0f} s"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _answers(host: str, port: int, ping: bool = False) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2) as s:
            if not ping:
                return True
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
