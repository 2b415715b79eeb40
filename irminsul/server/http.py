"""The HTTP/1.1 connection under the app: deadlines for a request's headers and body, a cap on open connections.

uvicorn's h11 protocol has one timer, keep-alive, armed after a response: a client that sends its
headers a byte at a time, or never finishes its body, holds its connection (and a file descriptor)
for as long as it likes, and a few hundred such clients lock everyone else out. Here a request's
headers must arrive within `header_timeout` seconds of their first byte (of the connection, for
the first request) and its body within `body_timeout` seconds of its headers, or the connection
gets a 408 and is closed; a connection beyond `max_connections` gets a 503 and is closed at once.
Everything else is uvicorn's `H11Protocol`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("irminsul.server")


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float  # seconds from a request's first byte to the end of its headers
    body_timeout: float  # seconds from the end of the headers to the end of the body
    max_connections: int  # open connections; more are answered 503 and closed


def _raw_response(status: int, reason: str, message: str) -> bytes:
    """A whole response outside h11's state machine (the connection is closed right after it)."""
    body = message.encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines and a connection cap (module docstring).
    uvicorn builds one per connection: `http=functools.partial(GuardedH11Protocol, limits=...)`."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "headers" or "body" while a deadline runs

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.warning("refused a connection: %d are open (--max-connections)", self.limits.max_connections)
            self.transport.write(_raw_response(503, "Service Unavailable",
                                               "too many open connections (--max-connections); retry later"))
            self.transport.close()
            return
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        if self._phase is None and self.conn.their_state is h11.IDLE:  # the next request's headers begin
            self._arm("headers")
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._phase != "body":
            self._arm("body")
        elif state is not h11.IDLE and state is not h11.SEND_BODY:  # the whole request is in (or it failed)
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, phase: str) -> None:
        self._disarm()
        seconds = self.limits.header_timeout if phase == "headers" else self.limits.body_timeout
        self._phase, self._deadline = phase, self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._phase = self._deadline = None

    def _expired(self) -> None:
        phase, self._phase, self._deadline = self._phase, None, None
        if self.transport.is_closing():
            return
        log.debug("closed a connection from %s: its request %s took longer than %.0f s", self.client, phase,
                  self.limits.header_timeout if phase == "headers" else self.limits.body_timeout)
        cycle = self.cycle if phase == "body" else None
        if cycle is not None:
            # the app is waiting in receive(): it sees the client gone, and nothing it sends is written
            cycle.disconnected = True
            cycle.message_event.set()
        if cycle is None or not cycle.response_started:
            flag = "--timeout-header" if phase == "headers" else "--timeout-body"
            self.transport.write(_raw_response(408, "Request Timeout",
                                               f"the request's {phase} did not arrive in time ({flag})"))
        self.transport.close()
