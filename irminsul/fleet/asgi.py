"""The server's own FastAPI app, called in process: how a fleet replica answers what the ingress forwards.

A replica runs `irminsul.server.app.create_app` unchanged (every endpoint, error, limit, tenant and
stream is the single server's) and feeds it each forwarded request as an ASGI call: the scope the
ingress saw, the body it read, and an `http.disconnect` once the ingress stops listening (its client
left, or it gave up on this replica), so the app aborts the request's jobs as it would for a client
of its own. The lifespan (the model's engine thread, the store's threads) runs as under uvicorn.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp


@dataclass(frozen=True)
class Forwarded:
    """One HTTP request as the ingress received it (headers lower-cased, the body read whole)."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None

    def scope(self) -> dict:
        framing = {b"content-length", b"transfer-encoding", b"connection"}
        headers = [(k, v) for k, v in self.headers if k not in framing]
        headers.append((b"content-length", str(len(self.body)).encode()))
        return {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": self.query,
            "root_path": "",
            "headers": headers,
            "client": self.client,
            "server": None,
        }


class InProcessApp:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._events: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Run the app's startup (a failure raises here, with the app's message)."""
        self._events = asyncio.Queue()
        sent: asyncio.Queue = asyncio.Queue()
        await self._events.put({"type": "lifespan.startup"})
        self._task = asyncio.ensure_future(
            self.app({"type": "lifespan", "asgi": {"version": "3.0"}}, self._events.get, sent.put)
        )
        reply = await sent.get()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the server app did not start: {reply.get('message', reply['type'])}")
        self._sent = sent

    async def stop(self) -> None:
        if self._task is None or self._task.done():
            return
        assert self._events is not None  # start() makes the queue before the task
        await self._events.put({"type": "lifespan.shutdown"})
        try:
            await asyncio.wait_for(self._sent.get(), 60)
        except TimeoutError:
            self._task.cancel()

    async def call(self, request: Forwarded) -> AsyncIterator[dict]:
        """The app's `http.response.start` and `http.response.body` messages, in order. Closing the
        iterator early (the ingress stopped listening) is a disconnect."""
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(self.app(request.scope(), receive, messages.put))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    break
            if task.done() and not task.cancelled() and (error := task.exception()) is not None:
                raise error
        finally:
            gone.set()
            if not task.done():
                try:  # the app aborts its jobs on the disconnect; a stream's task ends when cancelled
                    await asyncio.wait_for(asyncio.shield(task), 1.0)
                except (TimeoutError, Exception):
                    task.cancel()
