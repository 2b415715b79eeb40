"""A fleet replica that is vLLM: vLLM's engine and OpenAI app, with Irminsul's connector, in a Ray Serve replica.

The replica builds what `vllm serve` builds (`AsyncLLM`, `build_app`, `init_app_state`: the pieces Ray
Serve LLM's vLLM engine builds too) from `irminsul vllm-serve`'s arguments (`integrations/vllm/serve.py`:
the connector, its scheduler, the CPU backend filled in) and answers the ingress's forwarded requests
through that app in process (`asgi.py`), so every endpoint and error is vLLM's own. vLLM spawns its
engine core in a child process, where the connector's scheduler side keeps the registry; the connector
serves the registry's journal on a Unix socket of this replica's (`integrations/vllm/journal.py`), and
the replica reports it in `record_routing_stats` through the same `JournalFeed` an Irminsul replica
uses (`replica.py`), so the content router ranks vLLM replicas with the same cost.

Load, as vLLM's front end sees it: requests whose first token is out are running, the others waiting,
with their whole prompts as queued prefill tokens (the front end cannot see what the connector will
load).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from types import SimpleNamespace

from irminsul.fleet.asgi import Forwarded, InProcessApp
from irminsul.fleet.feed import JournalFeed, RoutingStats, Snapshot
from irminsul.fleet.prompt import RouteKey
from irminsul.fleet.replica import Head, answer
from irminsul.fleet.router import ReplicaLoad


class VllmReplica:
    # (an async __init__, which Serve awaits: replica.py)
    async def __init__(self, vllm_args: list[str]):  # type: ignore[misc]  # (Serve awaits it)
        from ray import serve
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.app import build_app

        from irminsul.integrations.vllm.journal import RemoteJournal
        from irminsul.integrations.vllm.serve import parse, reserve_cores

        self.id = serve.get_replica_context().replica_id.unique_id
        self._dir = tempfile.mkdtemp(prefix="irminsul-journal-")  # (0700: only this user can connect)
        socket = os.path.join(self._dir, "journal")
        args = parse(list(vllm_args))
        if args.model_tag is not None:  # (as `vllm serve` takes its positional model)
            args.model = args.model_tag
        transfer = args.kv_transfer_config
        extra = {**(transfer.kv_connector_extra_config or {}), "journal_socket": socket}
        args.kv_transfer_config = dataclasses.replace(transfer, kv_connector_extra_config=extra)
        reserve_cores(args, os.environ)  # (read by the engine core, which inherits it)
        self._engine_context = build_async_engine_client(args)
        self.engine = await self._engine_context.__aenter__()
        tasks = await self.engine.get_supported_tasks()
        app = build_app(args, tasks, self.engine.model_config)
        await init_app_state(self.engine, app.state, args, tasks)
        # NOTE: vLLM's engine-error handler sets should_exit on the uvicorn server its launcher keeps here;
        # there is none in a replica (Serve replaces a failed one through check_health), but the read must work
        app.state.server = SimpleNamespace()
        self.app = InProcessApp(app)
        await self.app.start()
        self.journal = RemoteJournal(socket)  # (the engine core is up, its connector listening)
        self.naming = self.journal.naming()
        self.feed = JournalFeed(self.journal)
        self._reports = 0

    def record_replica_metadata(self) -> dict:
        return {**self.naming, "store_prefix": None}  # (no store credit: the router asks no Redis for vLLM's)

    def _load(self) -> ReplicaLoad:
        states = list(self.engine.output_processor.request_states.values())
        waiting = [s for s in states if s.is_prefilling]
        return ReplicaLoad(len(states) - len(waiting), len(waiting), sum(s.prompt_len for s in waiting))

    async def record_routing_stats(self) -> dict:
        self._reports += 1
        cut = await asyncio.to_thread(self.feed.cut)  # (a round trip to the engine core's process)
        return RoutingStats(self._reports, self._load(), *cut).as_dict()

    # the targeted calls answer None when their target is another replica (one gone: ray_router.py)

    async def journal_snapshot(self, target: str | None = None) -> Snapshot | None:
        return await asyncio.to_thread(self.feed.snapshot) if target in (None, self.id) else None

    async def prometheus(self, target: str | None = None) -> str | None:
        if target not in (None, self.id):
            return None
        body = [m.get("body", b"") async for m in self.app.call(Forwarded("GET", "/metrics", b"", (), b""))]
        return b"".join(body).decode()

    async def healthy(self, target: str | None = None) -> bool | None:
        return not self.engine.errored if target in (None, self.id) else None

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine failed is replaced."""
        if self.engine.errored:
            raise RuntimeError(f"vLLM's engine failed: {self.engine.dead_error}")

    async def http(self, request: Forwarded, route: RouteKey | None = None) -> AsyncIterator[Head | bytes]:
        """vLLM's app's answer to a forwarded request: a Head, then the body's chunks."""
        async for item in answer(self.app, self.id, request, route):
            yield item

    async def __del__(self):
        journal, app, context = (getattr(self, name, None) for name in ("journal", "app", "_engine_context"))
        if journal is not None:
            journal.close()
        if app is not None:
            await app.stop()
        if context is not None:  # the engine core's process stops here
            await context.__aexit__(None, None, None)
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)


class VllmTokenizer:
    """The prompt tokenizer of a vLLM replica's model, for the ingress's route keys: text encoded as vLLM's
    completions encode it (the checkpoint's Hugging Face tokenizer, its special tokens added)."""

    def __init__(self, model: str):
        from vllm.tokenizers import get_tokenizer

        self._tokenizer = get_tokenizer(model)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)
