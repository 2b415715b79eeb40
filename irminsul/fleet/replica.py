"""One fleet replica: the single server's app and engine in a Ray Serve replica, and what it reports.

The replica builds `ServerState` from the fleet's `ServerConfig` (the model, the engine thread, the
store's tiers: a `redis://` tier is the fleet's shared second level, which every replica opens as
the single server does) and serves the forwarded requests through `create_app`'s own handlers
(`asgi.py`). Serve polls `record_routing_stats` (load and the chunk journal's periods, `feed.py`);
`record_replica_metadata` says once what a router needs to fingerprint chunks as this replica does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from irminsul.fleet.asgi import Forwarded, InProcessApp
from irminsul.fleet.feed import JournalFeed, RoutingStats, Snapshot
from irminsul.fleet.prompt import RouteKey
from irminsul.fleet.router import ReplicaLoad
from irminsul.server.config import ServerConfig

log = logging.getLogger("irminsul.fleet")


@dataclass(frozen=True)
class Head:
    """The first item of a forwarded answer: its status and headers; the body's chunks follow."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


async def answer(
    app: InProcessApp, replica_id: str, request: Forwarded, route: RouteKey | None
) -> AsyncIterator[Head | bytes]:
    """A replica app's answer to a forwarded request: a Head (naming the replica and the router's
    choice), then the body's chunks."""
    async for message in app.call(request):
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", ()), (b"x-irminsul-replica", replica_id.encode())]
            if route is not None and route.explanation:
                headers.append((b"x-irminsul-route", route.explanation.encode()))
            yield Head(message["status"], tuple(headers))
        elif message.get("body"):
            yield message["body"]


def _load(client) -> ReplicaLoad:
    """(On the engine thread.) Requests admitted and running; queued ones, and the prompt tokens
    the engine will compute before a new request's (a chunk several queued requests share, once)."""
    load = client.engine.queued_load()
    return ReplicaLoad(load.running, client.queued, load.tokens)


class IrminsulReplica:
    # Serve awaits a deployment's async __init__ (its documented form for asynchronous setup); to
    # mypy an __init__ must return None
    async def __init__(self, config: ServerConfig, threads: int = 1):  # type: ignore[misc]  # (Serve awaits it)
        import torch
        from ray import serve

        from irminsul.server.app import ServerState, create_app

        torch.set_num_threads(threads)  # (OMP_NUM_THREADS is set for the process too, before torch loads)
        self.id = serve.get_replica_context().replica_id.unique_id
        self.state = await asyncio.to_thread(ServerState, config)
        self.app = InProcessApp(create_app(config, self.state))
        await self.app.start()  # the engine thread starts here
        self.client = self.state.client
        self.feed = JournalFeed(self.client.engine.journal)
        self._reports = 0
        self._last_load = ReplicaLoad()

    def record_replica_metadata(self) -> dict:
        naming = self.client.engine.chunk_naming
        if naming is None:  # reuse off: nothing is cached, nothing to fingerprint
            return {}
        # store_prefix: the shared store's key prefix, for store credit
        return {
            "model_id": naming.model_id,
            "default_tenant": naming.default_tenant,
            "marker": list(naming.marker) if naming.marker else None,
            "sink": naming.sink,
            "max_prompt_chars": self.state.context * self.state.max_token_bytes,
            "store_prefix": naming.store_prefix,
        }

    async def record_routing_stats(self) -> dict:
        try:
            self._last_load = await asyncio.wait_for(asyncio.wrap_future(self.client.call(_load, self.client)), 2.0)
        except TimeoutError:  # (a long call ahead on the engine thread: the last load stands)
            pass
        self._reports += 1
        return RoutingStats(self._reports, self._last_load, *self.feed.cut()).as_dict()

    # the targeted calls answer None when their target is another replica (one gone: ray_router.py)

    async def journal_snapshot(self, target: str | None = None) -> Snapshot | None:
        return await asyncio.to_thread(self.feed.snapshot) if target in (None, self.id) else None

    async def prometheus(self, target: str | None = None) -> str | None:
        if target not in (None, self.id):
            return None
        await self.client.refresh_stats()
        text = self.state.metrics.render()
        return text.decode() if isinstance(text, bytes) else text

    async def healthy(self, target: str | None = None) -> bool | None:
        return self.client.alive if target in (None, self.id) else None

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine thread stopped is replaced."""
        if not self.client.alive:
            raise RuntimeError("the engine thread stopped")

    async def http(self, request: Forwarded, route: RouteKey | None = None) -> AsyncIterator[Head | bytes]:
        """The app's answer to a forwarded request: a Head, then the body's chunks."""
        async for item in answer(self.app, self.id, request, route):
            yield item

    async def __del__(self):
        app = getattr(self, "app", None)  # (None: it stopped before it started, e.g. at a fleet's shutdown)
        if app is not None:
            await app.stop()
