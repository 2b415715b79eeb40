"""Real servers on loopback (uvicorn in a thread, or `irminsul serve` subprocesses) and real Redis."""

import pytest

from tests.server.server_helpers import start
from tests.support.services import RedisProcess


@pytest.fixture(scope="module")
def server(tiny_dir):
    """One pic server with the memory store, shared by a test module."""
    s = start(tiny_dir)
    yield s
    s.stop()


@pytest.fixture
def redis_proc():
    proc = RedisProcess()  # fails (never skips) when redis-server is missing
    yield proc
    proc.stop()
