"""POST /v1/chat/completions and /v1/completions: validate, queue a job, answer or stream (SSE).

A request waits for its first event before the response starts, so a request that fails at
admission still gets a proper 4xx instead of an error inside a 200 stream. A client that goes
away (non-streaming: an ``http.disconnect`` while waiting; streaming: the response task is
cancelled) aborts its job, and the scheduler frees its rows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from irminsul.server.protocol import (MAX_CHOICES, APIError, ChatCompletionRequest, CompletionRequest,
                                      check_supported, constraint_of, parse_body, read_body, resolve_max_tokens,
                                      sampling_params, tool_functions, usage)
from irminsul.server.tools import ToolCallParser, forcing_constraint, parse_all
from irminsul.engine.sequence import TokenLogprob
from irminsul.server.engine_client import Delta, Failed, Finished, Job, QueueFull


class _Channel:
    """Events from the scheduler thread into this request's asyncio queue."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def emit(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            pass


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next(channel: _Channel, watcher: asyncio.Task):
    """The next event, or None when the client went away first."""
    getter = asyncio.ensure_future(channel.queue.get())
    done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if getter in done:
        return getter.result()
    getter.cancel()
    return None


def _summed(parts: list[dict]) -> dict:
    """Field by field sum of usage objects (nested blocks too)."""
    out = {}
    for key, value in parts[0].items():
        out[key] = _summed([p[key] for p in parts]) if isinstance(value, dict) else sum(p[key] for p in parts)
    return out


SEED_RANGE = 2**63  # SamplingParams takes seeds in [0, 2^63)


def text_chars(value) -> int:
    """Characters in every string of a request's messages (a lower bound on what rendering them
    makes: each is rendered, and the template adds its own)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(text_chars(v) for v in value)
    return 0


def _prompts(state, req: CompletionRequest) -> list[list[int]]:
    """A completion request's prompts: a string, token ids, or a list of either (a batch)."""
    prompt = req.prompt
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    for p in batch:
        if isinstance(p, str):
            state.check_text(len(p), "prompt", "prompt")
    return [state.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]


def prepare(state, request: Request, req, chat: bool) -> list[Job]:
    """Everything that can be refused before the jobs are queued: one job per prompt and choice
    (`n` choices of one prompt differ by seed when sampling: seed, seed + 1, ... modulo 2^63)."""
    check_supported(req)
    state.check_model(req.model)
    tenant = state.tenant_of(request, req.cache_salt)
    constraint, asked_by = constraint_of(req)
    if chat:
        functions = tool_functions(req)
        forced = forcing_constraint(state.renderer.tool_format, functions, req.tool_choice,
                                    state.tokenizer.added_token_id, parallel=req.parallel_tool_calls is not False
                                    ) if state.renderer.tool_format else None
        if forced is not None:
            if constraint is not None:
                raise APIError(400, f"tool_choice={req.tool_choice!r} and {asked_by} both constrain the output; "
                                    f"set only one", param=asked_by)
            constraint, asked_by = forced, "tool_choice"
        state.check_text(text_chars(req.messages), "messages", "messages")
        try:
            rendered = state.renderer.render(req.messages, req.tools, req.add_generation_prompt,
                                             req.continue_final_message, req.chat_template_kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        prompts, starts = [rendered.token_ids], rendered.segment_starts
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    else:
        requested = req.max_tokens
        if requested == 0 and not req.echo:
            raise APIError(400, "max_tokens=0 must be at least 1 (0 is taken only with echo=true: the prompt comes "
                                "back, scored with logprobs=N, and nothing is generated)", param="max_tokens")
        if requested == 0:  # as vLLM does it: one token is generated and not shown, so the prompt runs as any
            requested = 1  # request's does (admitted, cached, counted) and then is scored by the echo
        prompts, starts = _prompts(state, req), None
    if len(prompts) * req.n > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts x n={req.n} is more than {MAX_CHOICES} choices", param="n")
    if len(prompts) * req.n > state.client.max_queued_requests:  # (a 503 would never turn into a 200)
        raise APIError(400, f"{len(prompts)} prompts x n={req.n} choices are more than this server queues at once "
                            f"(--max-queued-requests {state.client.max_queued_requests})", param="n")
    shown_reason = _Format(chat, state.model_name, req, state.tokenizer, _tool_format(state, req, chat)).finish_reason
    jobs = []
    for tokens in prompts:
        try:
            state.client.validate(tokens)
        except ValueError as e:
            raise APIError(400, str(e), param="messages" if chat else "prompt") from None
        max_tokens = resolve_max_tokens(requested, len(tokens), state.context, state.config.default_max_tokens)
        params = sampling_params(req, max_tokens, constraint)
        if not state.client.fits(len(tokens) + max_tokens):
            raise APIError(400, f"the request needs {len(tokens)} prompt + {max_tokens} output rows but this "
                                f"server's KV pool holds {state.client.kv_rows} (--kv-cache-gib); shorten it or "
                                f"lower max_tokens")
        leader = None
        for i in range(req.n):
            seeded = params if params.seed is None or i == 0 else \
                dataclasses.replace(params, seed=(params.seed + i) % SEED_RANGE)
            jobs.append(Job(tokens=tokens, params=seeded, emit=None, segment_starts=starts, tenant=tenant,
                            matcher=_matcher(state, constraint, asked_by), leader=leader,
                            shown_reason=shown_reason))
            leader = leader or jobs[-1]  # the other choices share the first one's prompt rows
    return jobs


def _matcher(state, constraint, asked_by: str | None):
    """A fresh grammar state for one job (compiled here, on a worker thread, not the engine's)."""
    if constraint is None:
        return None
    try:
        return state.client.matcher(constraint)
    except ValueError as e:
        raise APIError(400, f"{asked_by}: {e}", param=asked_by) from None


async def handle(state, request: Request, chat: bool):
    state.key_tenant(request)  # (a 401 before the body is read)
    body = await read_body(request, state.config.max_request_bytes)
    # JSON parsing, chat rendering and tokenization run on a worker thread, never on the event loop.
    req = await state.prepare(request, parse_body, body, ChatCompletionRequest if chat else CompletionRequest)
    jobs = await state.prepare(request, prepare, state, request, req, chat)
    if len(jobs) > 1:
        return await _several(state, request, req, chat, jobs)
    job = jobs[0]
    channel = await submit_one(state, job)
    fmt = _Format(chat, state.model_name, req, state.tokenizer, _tool_format(state, req, chat))
    stream = (lambda first: _stream(state, [job], _Tagged(channel), fmt, (0, first))) if req.stream else None

    async def whole(event):
        echoes = [await _echo(state, request, job)] if not chat and req.echo else None
        return await json_response(state, request, fmt.response, [event], echoes)

    return await answer_one(state, request, job, channel, stream, whole)


async def json_response(state, request: Request, build, *args) -> Response:
    """``build(*args)`` as a JSON response, built and serialised on a worker thread: with every
    prompt token's log-probs (echo) it runs to tens of megabytes, seconds of work on the event loop."""
    return Response(await state.prepare(request, lambda: _dumps(build(*args)).encode()), media_type="application/json")


def _dumps(obj, depth: int = 2) -> str:
    """JSON text as JSONResponse writes it, an object's entries and a list's items (two levels down:
    each choice) one json.dumps call at a time: one call over tens of MB holds the GIL, and with it
    the event loop, for seconds."""
    if depth and isinstance(obj, dict):
        return "{" + ",".join(f"{_dumps(str(k), 0)}:{_dumps(v, depth - 1)}" for k, v in obj.items()) + "}"
    if depth and isinstance(obj, list):
        return "[" + ",".join(_dumps(v, depth - 1) for v in obj) + "]"
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


async def _echo(state, request: Request, job: Job):
    """The prompt's own log-probs: scored on the engine thread between steps (one scoring per step:
    runner.call), read into TokenLogprobs on a worker thread. NOTE: after the job has run: scored
    first, the prompt's rows would be cached before the job is admitted, and its usage would count
    the prompt as a prefix hit (cached_tokens) although nothing had sent it before."""
    scored = await state.client.score(job)
    return await state.prepare(request, _echo_entries, job, scored)


async def answer_one(state, request: Request, job: Job, channel: _Channel, stream, whole):
    """The answer to a one-job request once it is queued: its first event decides (a failure at
    admission is a 4xx, not an error inside a 200 stream), then `stream(first)` (the SSE chunks) or
    `await whole(finished)` (the JSON response). A client that goes away gets a 499 and its
    job is aborted."""
    watcher = asyncio.ensure_future(_disconnected(request))
    first = await first_event(state, job, channel, watcher)
    if first is None:
        return JSONResponse({}, status_code=499)  # nobody reads it
    if stream is not None:
        watcher.cancel()  # NOTE: from here Starlette cancels the body iterator when the client leaves
        return StreamingResponse(stream(first), media_type="text/event-stream")
    try:
        event = await last_event(state, job, channel, watcher, first)
    finally:
        watcher.cancel()
    if event is None:
        return JSONResponse({}, status_code=499)
    return await whole(event)


async def submit_one(state, job: Job, emit=None) -> _Channel:
    """Queue one job (its disk / Redis chunks prefetched first, off the engine thread); its events
    arrive on the returned channel, or go to `emit` if given."""
    await state.client.prefetch(job)
    channel = _Channel()
    job.emit = emit or channel.emit
    try:
        state.client.submit(job)
    except QueueFull as e:
        raise APIError(503, f"the server is overloaded: {e}; retry later") from None
    return channel


async def first_event(state, job: Job, channel: _Channel, watcher: asyncio.Task):
    """The job's first event (a failure at admission is raised: the response has not started);
    None if the client went away first (the job is aborted)."""
    first = await _next(channel, watcher)
    if first is None:
        state.client.abort(job)
        return None
    if isinstance(first, Failed):
        watcher.cancel()
        raise APIError(first.status, first.message)
    return first


async def last_event(state, job: Job, channel: _Channel, watcher: asyncio.Task, event=None):
    """Events until the job finishes -> its Finished event (a failure is raised); None if the client
    went away first (the job is aborted). The caller cancels the watcher."""
    while not isinstance(event, (Finished, Failed)):
        event = await _next(channel, watcher)
        if event is None:
            state.client.abort(job)
            return None
    if isinstance(event, Failed):
        raise APIError(event.status, event.message)
    return event


async def _several(state, request: Request, req, chat: bool, jobs: list[Job]):
    """n > 1 or a batch of prompts: every job runs in the engine's batch; one response, one choice
    per job, in order (prompt-major); streamed, each chunk names its choice's index."""
    fmt = _Format(chat, state.model_name, req, state.tokenizer, _tool_format(state, req, chat))
    merged = _Channel() if req.stream else None  # streaming: every job's events, tagged with its index
    channels = []
    try:
        for i, job in enumerate(jobs):
            channels.append(await submit_one(state, job, (lambda e, i=i: merged.emit((i, e))) if merged else None))
    except APIError:  # the queue is full: none of the request's jobs run
        for job in jobs[: len(channels)]:
            state.client.abort(job)
        raise
    if req.stream:  # (stream with echo is refused up front)
        return StreamingResponse(_stream(state, jobs, merged, fmt, None, len(jobs) // req.n),
                                 media_type="text/event-stream")
    watcher = asyncio.ensure_future(_disconnected(request))
    events = []
    try:
        for job, channel in zip(jobs, channels):
            event = await last_event(state, job, channel, watcher)
            if event is None:
                for j in jobs:
                    state.client.abort(j)
                return JSONResponse({}, status_code=499)
            events.append(event)
    except APIError:  # one choice failed: the others end too
        for j in jobs:
            state.client.abort(j)
        raise
    finally:
        watcher.cancel()
    echoes = [await _echo(state, request, job) for job in jobs] if not chat and req.echo else None
    return await json_response(state, request, fmt.response, events, echoes, len(jobs) // req.n)


def _tool_format(state, req, chat: bool):
    """(the syntax tool calls are parsed from, the functions that may be called): chat requests
    with tools, unless tool_choice is 'none'."""
    if not (chat and req.tools and req.tool_choice != "none" and state.renderer.tool_format):
        return None
    names = frozenset(f.get("name") for f in tool_functions(req))
    return state.renderer.tool_format, names


def _with_calls(reason: str, calls) -> str:
    """A choice's finish reason once its tool calls are parsed: tool_calls when the model stopped
    after making any (cut off by max_tokens it stays length, as OpenAI reports it)."""
    return "tool_calls" if calls and reason == "stop" else reason


def _echo_entries(job: Job, lp) -> tuple[list[int], list]:
    """(prompt tokens, TokenLogprob of every prompt token but the first)."""
    if lp is None:
        return job.tokens, []
    return job.tokens, [TokenLogprob.of(row, token, job.params.logprobs) for row, token in zip(lp, job.tokens[1:])]


class _Tagged:
    """One job's channel read as (choice index 0, event) pairs, as `_stream` reads several jobs'."""

    def __init__(self, channel: _Channel):
        self.channel = channel

    async def get(self):
        return 0, await self.channel.queue.get()


async def _stream(state, jobs: list[Job], channel, fmt: "_Format", first, prompts: int = 1):
    """Server-sent chunks for one or several jobs; `channel` yields (choice index, event) pairs
    (`first`, if given, is the first pair, already read). Each choice has its own tool-call parser
    and finishes on its own; the usage chunk, when asked for, comes after the last choice."""
    get = channel.get if isinstance(channel, _Tagged) else channel.queue.get
    done = False
    try:
        if fmt.chat:
            for i in range(len(jobs)):
                yield fmt.sse(fmt.chunk({"role": "assistant", "content": ""}, index=i))
        parsers = [ToolCallParser(fmt.tool_format, fmt.tool_names, fmt.max_calls) if fmt.tool_format is not None
                   else None for _ in jobs]
        finished: dict[int, Finished] = {}
        failed = False
        while len(finished) < len(jobs):
            i, event = first if first is not None else await get()
            first, parser = None, parsers[i]
            if isinstance(event, Delta) and parser is None:
                yield fmt.sse(fmt.chunk(event.text, logprobs=event.logprobs, index=i))
            elif isinstance(event, Delta):  # tool calls: the parser decides what the text is
                deltas = [fmt.tool_delta(e) for e in parser.feed(event.text)] or ([{}] if event.logprobs else [])
                for k, delta in enumerate(deltas):
                    yield fmt.sse(fmt.chunk(delta, logprobs=event.logprobs if k == 0 else (), index=i))
            elif isinstance(event, Finished):
                reason = event.finish_reason
                if parser is not None:
                    for e in parser.finish():
                        yield fmt.sse(fmt.chunk(fmt.tool_delta(e), index=i))
                    reason = _with_calls(reason, parser.calls)
                yield fmt.sse(fmt.chunk("" if not fmt.chat else {}, reason, index=i))
                finished[i] = event
            else:  # Failed mid-stream: an error object, as vLLM sends it; the other choices end too
                yield fmt.sse(APIError(event.status, event.message).body())
                failed = True
                for job in jobs:
                    state.client.abort(job)
                break
        if fmt.include_usage and not failed:
            yield fmt.sse(fmt.usage_chunk([finished[i] for i in range(len(jobs))], prompts))
        yield "data: [DONE]\n\n"
        done = True
    finally:
        if not done:
            for job in jobs:
                state.client.abort(job)


class _Format:
    """OpenAI response and chunk objects for one request."""

    def __init__(self, chat: bool, model: str, req, tokenizer, tool_format=None):
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.tool_format, self.tool_names = tool_format or (None, None)
        self.max_calls = 1 if chat and req.parallel_tool_calls is False else None
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.skip_special = req.skip_special_tokens  # the log-probs' token texts follow the output text
        # completions' echo: a prompt sent as a string comes back as that string, not as its decoding
        prompt = None if chat else req.prompt
        self.n = req.n
        self.echo_only = not chat and req.echo and req.max_tokens == 0  # the prompt scored, nothing generated
        self.prompt_strings = [prompt] if isinstance(prompt, str) else \
            list(prompt) if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt) else None

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, entries, text_start: int = 0) -> dict | None:
        """OpenAI's logprobs object for generated tokens (chat: `content`; completions: the legacy
        parallel lists). A sampled special token shows as the output text shows it
        (skip_special_tokens); an alternative always by its own text, as vLLM names it, or a client
        could not tell which one it was. Chat: a token's text is its own decoding (U+FFFD for a
        piece of a multi-byte character, as OpenAI's API shows it) and `bytes` carry its real bytes.
        Completions: a token's text is what it completes of the output text (a piece of a
        multi-byte character: "", then the character with its last piece), so the tokens join to
        the text and `text_offset` indexes it, as lm-evaluation-harness reads them; an alternative
        that is such a piece shows as `bytes:\\xNN`."""
        if not entries:
            return None
        tok, skip = self.tokenizer, self.skip_special
        if self.chat:
            def one(t, lp, skip_special):
                return {"token": tok.decode([t], skip_special_tokens=skip_special), "logprob": lp,
                        "bytes": list(tok.token_bytes(t, skip_special))}

            return {"content": [{**one(e.token, e.logprob, skip),
                                 "top_logprobs": [one(t, v, False) for t, v in e.top]} for e in entries]}

        def shown(t: int) -> str:  # (an alternative: skipped, every special token would be the one key "")
            b = tok.token_bytes(t, False)
            try:
                return b.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

        tokens, offsets, chars = [], [], 0
        completes = tok.decode_stream(skip)  # (the engine's own detokenizer: the same text, piece by piece)
        for e in entries:
            offsets.append(text_start + chars)
            piece = "" if e.stop else completes(e.token)  # the text holds no stop token
            tokens.append(piece)
            chars += len(piece)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{shown(t): v for t, v in e.top} for e in entries], "text_offset": offsets}

    def chunk(self, delta, finish_reason: str | None = None, logprobs=(), index: int = 0) -> dict:
        if self.chat:
            d = delta if isinstance(delta, dict) else {"content": delta}
            choice = {"index": index, "delta": d, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    @staticmethod
    def tool_delta(event: tuple) -> dict:
        """A ToolCallParser event as a chat delta: content, a call's start (id, name), its arguments."""
        if event[0] == "content":
            return {"content": event[1]}
        if event[0] == "name":
            return {"tool_calls": [{"index": event[1], "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                    "function": {"name": event[2], "arguments": ""}}]}
        return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}

    def message(self, event: Finished) -> tuple[dict, str]:
        """The assistant message of a finished chat choice, and its finish reason."""
        if self.tool_format is None:
            return {"role": "assistant", "content": event.text}, event.finish_reason
        content, calls = parse_all(self.tool_format, event.text, self.tool_names, self.max_calls)
        message = {"role": "assistant", "content": content}
        if not calls:
            return message, event.finish_reason
        message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message, _with_calls(event.finish_reason, calls)

    def finish_reason(self, event: Finished) -> str:
        """The finish reason a finished job's client is sent, for /metrics to count the same (run on
        the engine thread: a chat answer's tool calls are parsed there once more)."""
        if self.echo_only:
            return "length"
        if self.tool_format is None or event.finish_reason != "stop":
            return event.finish_reason
        return _with_calls(event.finish_reason, parse_all(self.tool_format, event.text, self.tool_names,
                                                          self.max_calls)[1])

    @staticmethod
    def prompt_only(event: Finished) -> Finished:
        """echo with max_tokens=0: the token generated to run the prompt is dropped, as vLLM drops it."""
        return dataclasses.replace(event, text="", finish_reason="length", completion_tokens=0,
                                   logprobs=None if event.logprobs is None else ())

    def usage_chunk(self, events: list[Finished], prompts: int = 1) -> dict:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": self.usage(events, prompts)}

    @staticmethod
    def usage(events: list[Finished], prompts: int = 1) -> dict:
        """Usage of a request's choices: each distinct prompt once (n choices share it), every output."""
        per = len(events) // prompts
        total = _summed([usage(e.stats, 0) for e in events[::per]])
        total["completion_tokens"] = sum(e.completion_tokens for e in events)
        total["total_tokens"] += total["completion_tokens"]
        return total

    def choice(self, event: Finished, index: int = 0, echo: tuple[list[int], list] | None = None) -> dict:
        if self.chat:
            message, reason = self.message(event)
            return {"index": index, "message": message, "logprobs": self.logprobs(event.logprobs),
                    "finish_reason": reason}
        text, logprobs = event.text, self.logprobs(event.logprobs)
        if echo is not None:  # the prompt first: its text, and its tokens' log-probs (the first has none)
            tokens, entries = echo
            sent = self.prompt_strings[index // self.n] if self.prompt_strings else None
            prompt = sent if sent is not None else self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special)
            text = prompt + text
            if event.logprobs is not None or entries:
                empty = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                before = self.logprobs([TokenLogprob(tokens[0], None), *entries])
                before["top_logprobs"][0] = None
                after = self.logprobs(event.logprobs, text_start=len(prompt)) or empty
                logprobs = {k: before[k] + after[k] for k in empty}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": event.finish_reason}

    def response(self, events: list[Finished], echoes: list | None = None, prompts: int = 1) -> dict:
        """One choice per event, in order; usage counts each distinct prompt once (n choices share it)."""
        head = self._head("chat.completion" if self.chat else "text_completion")
        if self.echo_only:
            events = [self.prompt_only(e) for e in events]
        choices = [self.choice(e, i, echoes[i] if echoes else None) for i, e in enumerate(events)]
        return {**head, "choices": choices, "usage": self.usage(events, prompts)}

    @staticmethod
    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
