"""`irminsul serve --replicas 2 --start-redis` as an operator runs it: a readiness probe during start-up,
a replica lost, then SIGTERM stops the whole fleet (Ray, its agents, its workers, the Redis).

One fleet start (~30 s on two cores) checks it all; every process it starts shares the session the
test gives it, which is how the test finds what is left.
"""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.services import free_port, wait_for

pytest.importorskip("ray.serve")
if subprocess.run(["which", "redis-server"], capture_output=True).returncode:
    pytest.skip("redis-server is not installed", allow_module_level=True)


def session_processes(sid: int) -> dict[int, str]:
    """Living processes of session `sid`: pid -> command line."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] == "Z" or int(fields[3]) != sid:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except (OSError, IndexError, ValueError):
            continue
    return found


def probe(url: str):
    """(status, body) of one /health, None while nothing listens yet."""
    try:
        r = httpx.get(url + "/health", timeout=30)
    except httpx.TransportError:
        return None
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def test_health_says_starting_then_degraded_and_sigterm_stops_the_whole_fleet(tmp_path):
    port, redis_port = free_port(), free_port()
    log_path = tmp_path / "fleet.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "irminsul",
                "serve",
                "--replicas",
                "2",
                "--start-redis",
                "--store",
                f"redis://127.0.0.1:{redis_port}/0",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--no-compile-decode",
                "--kv-cache-gib",
                "0.25",
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        # -- start-up: a 503 that says "starting" (never a 500, never a traceback) until both serve
        answers = []
        end = time.monotonic() + 240
        while time.monotonic() < end and proc.poll() is None:
            answer = probe(url)
            if answer is not None:
                answers.append(answer)
                if answer[0] == 200:
                    break
            time.sleep(0.5)
        started_log = log_path.read_text(errors="replace")
        assert answers and answers[-1][0] == 200, (answers[-3:], started_log[-3000:])
        # (Serve's proxy listens a moment before the app's route exists: a 404 then, before any other answer)
        while answers and answers[0][0] == 404 and len(answers) > 1:
            answers.pop(0)
        for status, body in answers:
            assert status in (200, 503), (status, body)
            assert isinstance(body, dict), body
            if status == 503:
                assert body["status"] == "starting" and body["replicas"] == 2, body
        status, body = answers[-1]
        assert body["status"] == "ok" and body["replicas_ready"] == body["replicas"] == 2, body
        assert "Traceback" not in started_log, started_log[-3000:]
        print(f"\n/health during start-up: {[(s, b['status'], b['replicas_ready']) for s, b in answers]}")

        # -- a replica lost: still 200, "degraded", with the count
        replicas = [pid for pid, cmd in session_processes(proc.pid).items() if "IrminsulReplica" in cmd]
        assert len(replicas) == 2, session_processes(proc.pid)
        os.kill(replicas[0], signal.SIGKILL)
        degraded = wait_for(
            lambda: (a := probe(url)) and a[1].get("status") == "degraded" and a,
            30,
            "/health to say degraded",
            interval=0.3,
        )
        assert degraded[0] == 200 and degraded[1]["replicas_ready"] == 1, degraded
        # once Serve dropped it (a health call to it must not wedge the router): the fleet still answers
        time.sleep(3)
        assert probe(url)[1]["replicas_ready"] >= 1
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text

        # -- SIGTERM: the process and everything it started are gone within 30 s
        assert len(session_processes(proc.pid)) > 5  # (Redis, Ray's GCS, raylet, agents, workers)
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        wait_for(
            lambda: not session_processes(proc.pid),
            max(0.5, 30 - (time.monotonic() - stopping)),
            "every process of the fleet to exit",
        )
        took = time.monotonic() - stopping
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{redis_port}", timeout=1)  # (the Redis it started)
        print(f"SIGTERM: the fleet stopped in {took:.1f} s (exit {proc.returncode})")
    finally:
        left = session_processes(proc.pid)
        for pid in left:  # (what a failed run left: this test's own processes)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if proc.poll() is None:
            proc.wait(10)
    assert not left, left
