"""POST /v1/completions: prompts (a string, token ids, or a batch of either) -> text choices, echo and scoring."""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from irminsul.engine.sequence import TokenLogprob
from irminsul.server.engine_client import Delta, Finished, Job
from irminsul.server.errors import APIError
from irminsul.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from irminsul.server.serving_base import Merged, OpenAIServing, Prompts, ResponseHead, disconnected, sse, usage_of
from irminsul.server.translate import check_supported, constraint_of


def prompt_batch(prompt) -> list:
    """A completion request's prompts: a string, token ids, or a list of either (a batch)."""
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


def batch_token_ids(tokenizer, batch: list) -> list[list[int]]:
    """Each prompt of a batch as token ids: a string encoded, token ids as they are."""
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]


@dataclasses.dataclass(frozen=True)
class Echo:
    """An echoed prompt: its tokens, and the log-prob of each but the first (when asked for)."""

    tokens: list[int]
    logprobs: list[TokenLogprob]


class CompletionFormat:
    """A completion request's response and chunk objects."""

    def __init__(self, model: str, req: CompletionRequest, tokenizer):
        self.head, self.tokenizer = ResponseHead("cmpl", model), tokenizer
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.skip_special = req.skip_special_tokens  # the log-probs' token texts follow the output text
        self.n = req.n
        self.echo_only = req.echo and req.max_tokens == 0  # the prompt scored, nothing generated
        # echo: a prompt sent as a string comes back as that string, not as its decoding
        prompt = req.prompt
        self.prompt_strings: list[str] | None = None
        if isinstance(prompt, str):
            self.prompt_strings = [prompt]
        elif prompt and all(isinstance(p, str) for p in prompt):
            self.prompt_strings = [p for p in prompt if isinstance(p, str)]  # (every one)

    def logprobs(self, entries, text_start: int = 0) -> CompletionLogprobs | None:
        """The legacy parallel lists for generated tokens. A token's text is what it completes of the
        output text (a piece of a multi-byte character: "", then the character with its last piece),
        so the tokens join to the text and `text_offset` indexes it, as lm-evaluation-harness reads
        them; an alternative always shows by its own text, as vLLM names it (one that is such a piece
        as `bytes:\\xNN`), or a client could not tell which one it was."""
        return self._logprobs(entries, text_start) if entries else None

    def _logprobs(self, entries, text_start: int = 0) -> CompletionLogprobs:
        tok = self.tokenizer

        def shown(t: int) -> str:  # (an alternative: skipped, every special token would be the one key "")
            b = tok.token_bytes(t, False)
            try:
                return b.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

        tokens, offsets, chars = [], [], 0
        completes = tok.decode_stream(self.skip_special)  # (the engine's own detokenizer: the same text)
        for e in entries:
            offsets.append(text_start + chars)
            piece = "" if e.stop else completes(e.token)  # the text holds no stop token
            tokens.append(piece)
            chars += len(piece)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[{shown(t): v for t, v in e.top} for e in entries],
            text_offset=offsets,
        )

    def finish_reason(self, event: Finished) -> str:
        """The finish reason a finished job's client is sent (for /metrics to count the same)."""
        return "length" if self.echo_only else event.finish_reason

    @staticmethod
    def prompt_only(event: Finished) -> Finished:
        """echo with max_tokens=0: the token generated to run the prompt is dropped, as vLLM drops it."""
        return dataclasses.replace(
            event, text="", finish_reason="length", completion_tokens=0, logprobs=None if event.logprobs is None else ()
        )

    def choice(self, event: Finished, index: int = 0, echo: Echo | None = None) -> CompletionChoice:
        text, logprobs = event.text, self.logprobs(event.logprobs)
        if echo is not None:  # the prompt first: its text, and its tokens' log-probs (the first has none)
            sent = self.prompt_strings[index // self.n] if self.prompt_strings else None
            prompt = (
                sent if sent is not None else self.tokenizer.decode(echo.tokens, skip_special_tokens=self.skip_special)
            )
            text = prompt + text
            if event.logprobs is not None or echo.logprobs:
                # (the first token has no log-prob: a placeholder's, then None in the lists)
                before = self._logprobs([TokenLogprob(echo.tokens[0], 0.0), *echo.logprobs])
                before.token_logprobs[0] = before.top_logprobs[0] = None
                after = self.logprobs(event.logprobs, text_start=len(prompt))
                if after is not None:
                    before = CompletionLogprobs(
                        **{k: getattr(before, k) + getattr(after, k) for k in CompletionLogprobs.model_fields}
                    )
                logprobs = before
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=event.finish_reason)

    def response(
        self, events: list[Finished], echoes: list[Echo] | None = None, prompts: int = 1
    ) -> CompletionResponse:
        """One choice per event, in order; usage counts each distinct prompt once (n choices share it)."""
        if self.echo_only:
            events = [self.prompt_only(e) for e in events]
        choices = [self.choice(e, i, echoes[i] if echoes else None) for i, e in enumerate(events)]
        return CompletionResponse(**self.head.fields(), choices=choices, usage=usage_of(events, prompts))

    # -- streamed (serving_base.OpenAIServing.stream's ChunkWriter) -------------------------

    def _chunk(self, text: str, index: int, finish_reason: str | None = None, logprobs=()) -> str:
        choice = CompletionChoice(index=index, text=text, logprobs=self.logprobs(logprobs), finish_reason=finish_reason)
        return sse(
            CompletionChunk(**self.head.fields(), choices=[choice]), exclude=None if self.include_usage else {"usage"}
        )

    def opening(self, choices: int) -> list[str]:
        return []

    def event(self, index: int, event) -> list[str]:
        if isinstance(event, Delta):
            return [self._chunk(event.text, index, logprobs=event.logprobs)]
        return [self._chunk("", index, event.finish_reason)]

    def usage(self, events: list[Finished], prompts: int = 1) -> str:
        return sse(CompletionChunk(**self.head.fields(), choices=[], usage=usage_of(events, prompts)))


class OpenAIServingCompletion(OpenAIServing):
    request_model = CompletionRequest

    async def create(self, request: Request):
        state = self.state
        req = await self.parsed(request)
        jobs = await state.prepare(request, self.prepare, request, req)
        fmt = CompletionFormat(state.model_name, req, state.tokenizer)
        prompts = len(jobs) // req.n
        merged = Merged() if req.stream and len(jobs) > 1 else None
        if len(jobs) == 1:
            channel = await self.submit(jobs[0])
            stream = (lambda first: self.stream(jobs, channel, fmt, (0, first))) if req.stream else None

            async def whole(event):
                echoes = [await self.echo(request, jobs[0])] if req.echo else None
                if echoes is not None and echoes[0] is None:
                    return JSONResponse({}, status_code=499)  # nobody reads it
                return await self.json_response(request, fmt.response, [event], echoes)

            return await self.answer_one(request, jobs[0], channel, stream, whole)
        channels = await self.submit_all(jobs, merged)
        if merged is not None:  # streamed (stream with echo is refused up front)
            return StreamingResponse(self.stream(jobs, merged, fmt, None, prompts), media_type="text/event-stream")
        events = await self.finish_all(request, jobs, channels)
        if events is None:
            return JSONResponse({}, status_code=499)
        echoes: list[Echo] = []
        for i, job in enumerate(jobs if req.echo else ()):
            if i % req.n:  # the n choices of one prompt (consecutive jobs) share its scoring
                echoes.append(echoes[-1])
                continue
            echo = await self.echo(request, job)
            if echo is None:
                return JSONResponse({}, status_code=499)
            echoes.append(echo)
        return await self.json_response(request, fmt.response, events, echoes or None, prompts)

    def prepare(self, request: Request, req: CompletionRequest) -> list[Job]:
        """The request's jobs (on a worker thread): one per prompt and choice."""
        state = self.state
        check_supported(req)
        state.check_model(req.model)
        constraint, asked_by = constraint_of(req)
        requested = req.max_tokens
        if requested == 0 and not req.echo:
            raise APIError(
                400,
                "max_tokens=0 must be at least 1 (0 is taken only with echo=true: the prompt comes "
                "back, scored with logprobs=N, and nothing is generated)",
                param="max_tokens",
            )
        if requested == 0:  # as vLLM does it: one token is generated and not shown, so the prompt runs as any
            requested = 1  # request's does (admitted, cached, counted) and then is scored by the echo
        fmt = CompletionFormat(state.model_name, req, state.tokenizer)
        return self.jobs(
            request, req, Prompts(self._token_ids(req), requested, constraint, asked_by), fmt.finish_reason
        )

    def _token_ids(self, req: CompletionRequest) -> list[list[int]]:
        """A completion request's prompts: a string, token ids, or a list of either (a batch)."""
        batch = prompt_batch(req.prompt)
        for p in batch:
            if isinstance(p, str):
                self.state.check_text(len(p), "prompt", "prompt")
        return batch_token_ids(self.state.tokenizer, batch)

    async def echo(self, request: Request, job: Job) -> Echo | None:
        """The prompt's own log-probs: scored on the engine thread between steps (one scoring per step),
        read into TokenLogprobs on a worker thread; None if the client went away first (the scoring is
        stopped between its passes). NOTE: after the job has run: scored first, the prompt's rows
        would be cached before the job is admitted, and its usage would count the prompt as a prefix
        hit (cached_tokens) although nothing had sent it before."""
        watcher = asyncio.ensure_future(disconnected(request))
        scoring = asyncio.ensure_future(self.client.score(job))
        try:
            await asyncio.wait({scoring, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not scoring.done():
            self.client.abort(job)
            scoring.cancel()  # (not started yet: never runs)
            return None
        return await self.state.prepare(request, _echo, job, scoring.result())


def _echo(job: Job, lp) -> Echo:
    n = job.params.logprobs
    if lp is None or n is None:  # (a job without logprobs is not scored: lp is None)
        return Echo(job.tokens, [])
    return Echo(job.tokens, [TokenLogprob.of(row, token, n) for row, token in zip(lp, job.tokens[1:])])
