"""`irminsul serve` stopping while streams are open."""

import os
import signal
import threading
import time

import httpx

from tests.support.services import ServerProcess


def test_a_forced_exit_with_streams_open_does_not_abort_the_process():
    """Ctrl-C twice (uvicorn's forced exit) with streams open skips the app's shutdown, so the CLI
    stops the engine thread itself; otherwise it dies inside a torch call and the process aborts
    ("terminate called without an active exception", exit 134) instead of exiting cleanly."""
    # the bundled model and long prompts: the engine thread is inside a torch call most of the time
    server = ServerProcess()  # (eager decoding: tests/conftest.py's environment)
    try:

        def stream(i):
            try:
                with httpx.stream(
                    "POST",
                    server.url + "/v1/completions",
                    timeout=30,
                    json={"prompt": [5 + i] * 1500, "max_tokens": 64, "stream": True, "ignore_eos": True},
                ) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass  # (a forced exit may close the connection: that is allowed)

        clients = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for c in clients:
            c.start()
        time.sleep(0.5)
        os.kill(server.proc.pid, signal.SIGINT)
        time.sleep(0.1)
        os.kill(server.proc.pid, signal.SIGINT)
        code = server.proc.wait(60)
        for c in clients:
            c.join(30)
        log = server.log.read_text()
        assert "terminate called" not in log and code in (0, 130), (code, log[-2000:])
    finally:
        server.stop()
