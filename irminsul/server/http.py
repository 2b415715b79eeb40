"""The HTTP/1.1 connection under the app: deadlines for reading a request and writing its answer, a
cap on a body's pieces, a cap on open connections.

uvicorn's h11 protocol has one timer, keep-alive, armed after a response: a client that sends its
headers a byte at a time, never finishes its body, or never reads its answer holds its connection
(and a file descriptor, and the answer's bytes) for as long as it likes, and a few hundred such
clients lock everyone else out. Here a request's headers must arrive within `header_timeout`
seconds of their first byte (of the connection, for the first request) and its body within
`body_timeout` seconds of its headers, or the connection gets a 408 and is closed; an answer the
client stops reading (bytes wait to be written and none drain for `write_timeout` seconds) is
dropped and the connection aborted; a connection beyond `max_connections` gets a 503 and is
closed at once.

A chunked body is one h11 event per chunk, each handled on the event loop (and appended to the
body read so far): a body of one-byte chunks is a million events. A request body may arrive in at
most `max_body_events` pieces (chunks, or reads of a long one); more get a 413 and the connection
is closed. Everything else is uvicorn's `H11Protocol`.
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
    write_timeout: float = 30.0  # seconds an answer may wait to be written with none of it read
    max_body_events: int = 32768  # pieces (chunks, or reads of one) a request body may arrive in


class _TooManyPieces(Exception):
    pass


class _CountedConnection(h11.Connection):
    """h11's connection, counting the current request's body events (a chunked body: one per chunk)."""

    def __init__(self, *args, max_body_events: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_body_events, self.body_events = max_body_events, 0

    def next_event(self):
        event = super().next_event()
        if isinstance(event, h11.Request):
            self.body_events = 0
        elif isinstance(event, h11.Data):
            self.body_events += 1
            if self.body_events > self.max_body_events:
                raise _TooManyPieces
        return event


def _raw_response(status: int, reason: str, message: str) -> bytes:
    """A whole response outside h11's state machine (the connection is closed right after it)."""
    body = message.encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read and write deadlines, a cap on a body's pieces and a connection
    cap (module docstring).
    uvicorn builds one per connection: `http=functools.partial(GuardedH11Protocol, limits=...)`."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.conn = _CountedConnection(
            h11.SERVER, self.conn._max_incomplete_event_size, max_body_events=limits.max_body_events
        )
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "headers" or "body" while a deadline runs
        self._write_deadline: asyncio.TimerHandle | None = None
        self._unwritten = 0  # bytes waiting to be written when the write deadline was armed

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.warning("refused a connection: %d are open (--max-connections)", self.limits.max_connections)
            self.transport.write(
                _raw_response(503, "Service Unavailable", "too many open connections (--max-connections); retry later")
            )
            self.transport.close()
            return
        # NOTE: paused whenever a byte waits to be written (not only past 64 KiB), so the write
        # deadline also covers an answer smaller than that which the client never reads
        transport.set_write_buffer_limits(high=0, low=0)
        self._arm("headers")

    def handle_events(self) -> None:
        try:
            super().handle_events()
        except _TooManyPieces:
            self._refuse_body(
                413,
                "Content Too Large",
                f"the request body came in more than {self.limits.max_body_events} pieces; send it in larger chunks",
            )

    # -- writing: paused while bytes wait, aborted when none drain for write_timeout -----------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._arm_write()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _arm_write(self) -> None:
        self._unwritten = self.transport.get_write_buffer_size()
        self._write_deadline = self.loop.call_later(self.limits.write_timeout, self._write_expired)

    def _write_expired(self) -> None:
        self._write_deadline = None
        if self.transport.is_closing() and self.transport.get_write_buffer_size() == 0:
            return
        left = self.transport.get_write_buffer_size()
        if 0 < left < self._unwritten:  # slow, but reading: another period
            self._arm_write()
            return
        log.debug(
            "aborted a connection from %s: %d bytes of its answer were not read in %.0f s (--timeout-write)",
            self.client,
            left,
            self.limits.write_timeout,
        )
        self.transport.abort()

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
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None
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
        log.debug(
            "closed a connection from %s: its request %s took longer than %.0f s",
            self.client,
            phase,
            self.limits.header_timeout if phase == "headers" else self.limits.body_timeout,
        )
        flag = "--timeout-header" if phase == "headers" else "--timeout-body"
        if phase == "body":
            self._refuse_body(408, "Request Timeout", f"the request's body did not arrive in time ({flag})")
        else:
            self.transport.write(
                _raw_response(408, "Request Timeout", f"the request's headers did not arrive in time ({flag})")
            )
            self.transport.close()

    def _refuse_body(self, status: int, reason: str, message: str) -> None:
        """End a request whose body is being read: the app (waiting in receive()) sees the client gone and
        nothing it sends is written; the client gets `status` unless an answer has started; closed."""
        self._disarm()
        cycle = self.cycle
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        if cycle is None or not cycle.response_started:
            self.transport.write(_raw_response(status, reason, message))
        self.transport.close()
