"""What the chat, completion and Responses endpoints share: request -> jobs, submission, events, errors.

A request waits for its first event before the response starts, so a request that fails at
admission still gets a proper 4xx instead of an error inside a 200 stream. A client that goes
away (non-streaming: an ``http.disconnect`` while waiting; streaming: the response task is
cancelled) aborts its jobs, and the scheduler frees their rows. Each endpoint's own module
(serving_chat.py, serving_completion.py, serving_responses.py) turns its request into prompts and
its events into response objects; everything between is here.

NOTE: the rule every endpoint keeps: nothing proportional to a request's size runs on the event
loop or the engine thread before its size is checked against a bound (limits.py's MAX_*, the
context, --max-request-bytes); work proportional to it runs on the worker threads (`state.prepare`).
/metrics' irminsul_event_loop_stall_seconds_max shows what slips through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from irminsul.engine.grammar import Constraint
from irminsul.server.body import parse_body, read_body
from irminsul.server.engine_client import Failed, Finished, Job, QueueFull, unsubmitted
from irminsul.server.errors import APIError, context_exceeded
from irminsul.server.limits import MAX_CHOICES
from irminsul.server.protocol import UsageInfo
from irminsul.server.translate import resolve_max_tokens, sampling_params, summed_usage, usage

SEED_RANGE = 2**63  # SamplingParams takes seeds in [0, 2^63)


@dataclass(frozen=True)
class FieldNames:
    """The request fields the shared checks name in their errors: the Responses API calls the
    chat request's messages `input`, its max_completion_tokens `max_output_tokens`."""

    prompt: str = "prompt"
    max_tokens: str = "max_tokens"
    response_format: str = "response_format"


@dataclass(frozen=True)
class Prompts:
    """What an endpoint's request asks the engine for, before it becomes jobs."""

    token_ids: list[list[int]]  # one prompt, or a completions batch
    requested_max_tokens: int | None
    constraint: Constraint | None = None  # the structured-output constraint
    constrained_by: str | None = None  # the field that asked for it (for errors)
    segment_starts: list[int] | None = None  # a rendered chat's message boundaries


def text_chars(value) -> int:
    """Characters in every string of a request's messages or tools, keys included (a lower bound on
    what rendering them makes: each is rendered, and the template adds its own)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + text_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(text_chars(v) for v in value)
    return 0


class Channel:
    """Events from the engine thread into this request's asyncio queue."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def emit(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            pass

    async def get(self) -> tuple[int, object]:
        """(choice index, event): one job's channel is choice 0; a merged one tags each event itself."""
        return 0, await self.queue.get()


class Merged(Channel):
    """Several jobs' events, each tagged with its choice index (n > 1, a batch of prompts)."""

    def emitter(self, index: int):
        return lambda event: self.emit((index, event))

    async def get(self) -> tuple[int, object]:
        return await self.queue.get()


class ResponseHead:
    """The id, creation time and model every object and chunk of one response carries."""

    def __init__(self, prefix: str, model: str):
        self.id, self.created, self.model = f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model

    def fields(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}


def usage_of(events: list[Finished], prompts: int = 1) -> UsageInfo:
    """Usage of a request's choices: each distinct prompt once (n choices share it), every output."""
    per = len(events) // prompts
    total = summed_usage([usage(e.stats, 0) for e in events[::per]])
    total.completion_tokens = sum(e.completion_tokens for e in events)
    total.total_tokens += total.completion_tokens
    return total


def sse(body: BaseModel | dict, exclude: set[str] | None = None) -> str:
    """One server-sent event's `data:` line."""
    obj = body.model_dump(exclude=exclude) if isinstance(body, BaseModel) else body
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def dumps(obj, depth: int = 2) -> str:
    """JSON text as JSONResponse writes it, an object's entries and a list's items (two levels down:
    each choice) one json.dumps call at a time: one call over tens of MB holds the GIL, and with it
    the event loop, for seconds."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump()
    if depth and isinstance(obj, dict):
        return "{" + ",".join(f"{dumps(str(k), 0)}:{dumps(v, depth - 1)}" for k, v in obj.items()) + "}"
    if depth and isinstance(obj, list):
        return "[" + ",".join(dumps(v, depth - 1) for v in obj) + "]"
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next(channel: Channel, watcher: asyncio.Task):
    """The next (index, event), or None when the client went away first."""
    getter = asyncio.ensure_future(channel.get())
    done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if getter in done:
        return getter.result()
    getter.cancel()
    return None


class OpenAIServing:
    """One endpoint over the server's state (ServerState) and its engine client."""

    request_model: type[BaseModel]
    names = FieldNames()

    def __init__(self, state):
        self.state, self.client = state, state.client

    async def parsed(self, request: Request):
        """The request's body as `request_model`: the API key checked first (a 401 before the body is
        read), the size limit while it is read, parsing on a worker thread."""
        state = self.state
        state.tenancy.key_tenant(request)
        body = await read_body(request, state.config.max_request_bytes)
        return await state.prepare(request, parse_body, body, self.request_model, state.context)

    # -- request -> jobs (on a worker thread) -----------------------------------------------

    def jobs(
        self, request: Request, req, prompts: Prompts, shown_reason=None, names: FieldNames | None = None
    ) -> list[Job]:
        """Everything that can be refused before the jobs are queued: one job per prompt and choice
        (`n` choices of one prompt differ by seed when sampling: seed, seed + 1, ... modulo 2^63).
        `shown_reason`: the finish reason the client is sent, for /metrics."""
        state, client, names = self.state, self.client, names or self.names
        n, count = req.n, len(prompts.token_ids)
        if count * n > MAX_CHOICES:
            raise APIError(400, f"{count} prompts x n={n} is more than {MAX_CHOICES} choices", param="n")
        if count * n > client.max_queued_requests:  # (a 503 would never turn into a 200)
            raise APIError(
                400,
                f"{count} prompts x n={n} choices are more than this server queues at once "
                f"(--max-queued-requests {client.max_queued_requests})",
                param="n",
            )
        tenant = state.tenancy.tenant_of(request, req.cache_salt)
        jobs = []
        for tokens in prompts.token_ids:
            if len(tokens) >= state.context:  # (one position must be left for the first output token)
                raise context_exceeded(
                    state.context,
                    f"your {names.prompt} resulted in {len(tokens)} tokens "
                    f"(at most {state.context - 1} leave room for an answer)",
                    names.prompt,
                    names.prompt,
                )
            try:
                client.validate(tokens)
            except ValueError as e:
                raise APIError(400, str(e), param=names.prompt) from None
            max_tokens = resolve_max_tokens(
                prompts.requested_max_tokens,
                len(tokens),
                state.context,
                state.config.default_max_tokens,
                names.max_tokens,
            )
            params = sampling_params(req, max_tokens, prompts.constraint)
            if not client.fits(len(tokens) + max_tokens):  # (the pool is this server's context)
                raise context_exceeded(
                    client.kv_rows,
                    f"this server's KV pool (--kv-cache-gib) holds "
                    f"{client.kv_rows} rows and the request needs {len(tokens)} "
                    f"prompt + {max_tokens} output rows",
                    names.prompt,
                    f"{names.prompt} or {names.max_tokens}",
                )
            leader = None
            for i in range(n):
                seeded = (
                    params
                    if params.seed is None or i == 0
                    else dataclasses.replace(params, seed=(params.seed + i) % SEED_RANGE)
                )
                jobs.append(
                    Job(
                        tokens=tokens,
                        params=seeded,
                        emit=unsubmitted,
                        segment_starts=prompts.segment_starts,
                        tenant=tenant,
                        matcher=self._matcher(prompts, tenant),
                        leader=leader,
                        shown_reason=shown_reason,
                    )
                )
                leader = leader or jobs[-1]  # the other choices share the first one's prompt rows
        return jobs

    def _matcher(self, prompts: Prompts, tenant: str | None):
        """A fresh grammar state for one job (compiled here, on a worker thread, not the engine's)."""
        if prompts.constraint is None:
            return None
        try:
            return self.client.matcher(prompts.constraint, tenant)
        except ValueError as e:
            raise APIError(400, f"{prompts.constrained_by}: {e}", param=prompts.constrained_by) from None

    # -- submission and events --------------------------------------------------------------

    async def submit(self, job: Job, emit=None) -> Channel:
        """Queue one job (its disk / Redis chunks prefetched first, off the engine thread); its events
        arrive on the returned channel, or go to `emit` if given."""
        await self.client.prefetch(job)
        channel = Channel()
        job.emit = emit or channel.emit
        try:
            self.client.submit(job)
        except QueueFull as e:  # (OpenAI's answer to "too many requests": clients back off and retry)
            raise APIError(
                429, f"the server is overloaded: {e}; retry later", code="rate_limit_exceeded", retry_after=1
            ) from None
        return channel

    async def submit_all(self, jobs: list[Job], merged: Merged | None) -> list[Channel]:
        """Queue every job of a request (all or none: a full queue aborts the ones already in)."""
        channels = []
        try:
            for i, job in enumerate(jobs):
                channels.append(await self.submit(job, merged.emitter(i) if merged else None))
        except APIError:
            self.abort(jobs[: len(channels)])
            raise
        return channels

    def abort(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.client.abort(job)

    async def first_event(self, job: Job, channel: Channel, watcher: asyncio.Task):
        """The job's first event (a failure at admission is raised: the response has not started);
        None if the client went away first (the job is aborted)."""
        first = await _next(channel, watcher)
        if first is None:
            self.client.abort(job)
            return None
        if isinstance(first[1], Failed):
            watcher.cancel()
            raise APIError(first[1].status, first[1].message)
        return first[1]

    async def last_event(self, job: Job, channel: Channel, watcher: asyncio.Task, event=None):
        """Events until the job finishes -> its Finished event (a failure is raised); None if the client
        went away first (the job is aborted). The caller cancels the watcher."""
        while not isinstance(event, (Finished, Failed)):
            got = await _next(channel, watcher)
            if got is None:
                self.client.abort(job)
                return None
            event = got[1]
        if isinstance(event, Failed):
            raise APIError(event.status, event.message)
        return event

    async def answer_one(self, request: Request, job: Job, channel: Channel, stream, whole):
        """The answer to a one-job request once it is queued: its first event decides (a failure at
        admission is a 4xx, not an error inside a 200 stream), then `stream(first)` (the SSE chunks) or
        `await whole(finished)` (the JSON response). A client that goes away gets a 499 and its
        job is aborted."""
        watcher = asyncio.ensure_future(disconnected(request))
        first = await self.first_event(job, channel, watcher)
        if first is None:
            return JSONResponse({}, status_code=499)  # nobody reads it
        if stream is not None:
            watcher.cancel()  # NOTE: from here Starlette cancels the body iterator when the client leaves
            return StreamingResponse(stream(first), media_type="text/event-stream")
        try:
            event = await self.last_event(job, channel, watcher, first)
        finally:
            watcher.cancel()
        if event is None:
            return JSONResponse({}, status_code=499)
        return await whole(event)

    async def finish_all(self, request: Request, jobs: list[Job], channels: list[Channel]) -> list[Finished] | None:
        """Every job's Finished event, in order; None if the client went away (all are aborted). One
        choice failing ends the others too."""
        watcher = asyncio.ensure_future(disconnected(request))
        events = []
        try:
            for job, channel in zip(jobs, channels):
                event = await self.last_event(job, channel, watcher)
                if event is None:
                    self.abort(jobs)
                    return None
                events.append(event)
        except APIError:
            self.abort(jobs)
            raise
        finally:
            watcher.cancel()
        return events

    async def json_response(self, request: Request, build, *args) -> Response:
        """``build(*args)`` (a response model) as a JSON response, built and serialised on a worker
        thread: with every prompt token's log-probs (echo) it runs to tens of megabytes, seconds of
        work on the event loop."""
        text = await self.state.prepare(request, lambda: dumps(build(*args)).encode())
        return Response(text, media_type="application/json")

    async def stream(self, jobs: list[Job], channel: Channel, chunks, first=None, prompts: int = 1):
        """Server-sent events for one or several jobs; `channel` yields (choice index, event) pairs
        (`first`, if given, is the first pair, already read). `chunks` (the endpoint's ChunkWriter)
        turns each event into chunks; a failure mid-stream is an error object, as vLLM sends it, and
        ends the other choices too; the usage chunk, when asked for, comes after the last choice."""
        done = False
        try:
            for line in chunks.opening(len(jobs)):
                yield line
            finished: dict[int, Finished] = {}
            failed = False
            while len(finished) < len(jobs):
                i, event = first if first is not None else await channel.get()
                first = None
                if isinstance(event, Failed):
                    yield sse(APIError(event.status, event.message).body())
                    failed = True
                    self.abort(jobs)
                    break
                for line in chunks.event(i, event):
                    yield line
                if isinstance(event, Finished):
                    finished[i] = event
            if chunks.include_usage and not failed:
                yield chunks.usage([finished[i] for i in range(len(jobs))], prompts)
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:
                self.abort(jobs)
