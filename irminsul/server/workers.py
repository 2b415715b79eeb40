"""The threads that prepare requests, shared fairly between tenants.

Parsing a body, rendering a chat, tokenizing, compiling an output constraint and building a large
response run on these threads, never on the event loop or the engine thread. Some of that work can
take a request's sender long (a constraint of 100,000 choices compiles for many seconds); without a
share, a few such requests from one tenant hold every thread and everyone else's request waits
behind them. Each tenant (its API key; without keys, its client's address) holds at most
`per_tenant` of the `threads` at once: its further work waits for its own, never for another's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
from collections.abc import Callable
from typing import Any


class Workers:
    def __init__(self, threads: int, per_tenant: int):
        self.per_tenant = per_tenant
        self.executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="irminsul-prep")
        self._shares: dict[str | None, list] = {}  # tenant -> [Semaphore, users]: event loop only

    async def run(self, tenant: str | None, fn: Callable, *args) -> Any:
        """``fn(*args)`` on a worker thread, at most `per_tenant` of this tenant's at once."""
        share = self._shares.setdefault(tenant, [asyncio.Semaphore(self.per_tenant), 0])
        share[1] += 1
        loop = asyncio.get_running_loop()
        try:
            await share[0].acquire()
        except BaseException:
            self._leave(tenant, share)
            raise

        def release(_):  # NOTE: when the thread is done, not when the caller stops waiting (cancelled)
            try:
                loop.call_soon_threadsafe(self._release, tenant, share)
            except RuntimeError:  # the loop is gone (shutdown)
                pass

        call = functools.partial(contextvars.copy_context().run, fn, *args)
        try:
            future = self.executor.submit(call)
        except BaseException:
            self._release(tenant, share)
            raise
        future.add_done_callback(release)
        return await asyncio.wrap_future(future)

    def _release(self, tenant, share: list) -> None:
        share[0].release()
        self._leave(tenant, share)

    def _leave(self, tenant, share: list) -> None:
        share[1] -= 1
        if share[1] == 0 and self._shares.get(tenant) is share:  # (no table entry outlives its tenant's work)
            del self._shares[tenant]

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
