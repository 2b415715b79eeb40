"""One deadline for a whole Redis command: its connection, handshake, request and whole reply.

redis-py's socket timeout bounds each read alone: a server that answers with a bulk header and then
a byte at a time, each sooner than that timeout, holds a command as long as it likes.
``call(seconds, fn)`` runs a command under a deadline for the calling thread; a client built with
``redis_connect_func=on_connect`` wraps each connection's socket so that every send and receive
waits at most until that deadline, and past it raises the timeout redis-py reports as its own
``TimeoutError``. ``on_connect`` also turns a handshake no Redis would answer (HELLO answered with
+OK) into a ``ConnectionError`` that says so.
"""

from __future__ import annotations

import socket
import threading
import time

_deadline = threading.local()  # .at: when the command running on this thread must be done (time.monotonic)


def call(seconds: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with every socket operation of this thread's connections bounded by
    one deadline ``seconds`` from now."""
    _deadline.at = time.monotonic() + seconds
    try:
        return fn(*args, **kwargs)
    finally:
        _deadline.at = None


class DeadlineSocket:
    """A connected socket whose sends and receives wait at most until the deadline of the command
    running on the calling thread (and at most the timeout redis-py sets, which may be 0: a poll)."""

    def __init__(self, sock: socket.socket):
        self._sock, self._timeout = sock, sock.gettimeout()

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def _arm(self) -> None:
        at, timeout = getattr(_deadline, "at", None), self._timeout
        if at is not None:
            left = at - time.monotonic()
            if left <= 0:
                raise TimeoutError("the command's deadline has passed")
            timeout = left if timeout is None else min(timeout, left)
        self._sock.settimeout(timeout)

    def recv(self, *args):
        self._arm()
        return self._sock.recv(*args)

    def recv_into(self, *args):
        self._arm()
        return self._sock.recv_into(*args)

    def send(self, *args):
        self._arm()
        return self._sock.send(*args)

    def sendall(self, *args):
        self._arm()
        return self._sock.sendall(*args)


def on_connect(connection) -> None:
    """redis-py's handshake, over a socket bound by the command's deadline. A reply no Redis sends
    (HELLO answered with +OK) is a ConnectionError that says so, not whatever redis-py trips on."""
    import redis

    connection._sock = DeadlineSocket(connection._sock)  # NOTE: redis-py reads and writes only through it
    try:
        connection.on_connect()
    except (redis.RedisError, OSError):
        raise
    except Exception as e:
        raise redis.ConnectionError(
            f"the handshake got a reply no Redis sends ({type(e).__name__}: {e}); is a Redis server at this address?"
        ) from None
