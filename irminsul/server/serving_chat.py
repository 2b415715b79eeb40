"""POST /v1/chat/completions: messages rendered with the checkpoint's template -> assistant messages and tool calls."""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from irminsul.server.engine_client import Delta, Finished, Job
from irminsul.server.errors import APIError
from irminsul.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    TopLogprob,
)
from irminsul.server.serving_base import (
    FieldNames,
    Merged,
    OpenAIServing,
    Prompts,
    ResponseHead,
    sse,
    text_chars,
    usage_of,
)
from irminsul.server.tools import CallStart, Content, ToolCallParser, ToolEvent, ToolFormat, parse_all, tool_constraint
from irminsul.server.translate import check_supported, check_text_only, constraint_of, tool_functions


def with_calls(reason: str, calls) -> str:
    """A choice's finish reason once its tool calls are parsed: tool_calls when the model stopped
    after making any (cut off by max_tokens it stays length, as OpenAI reports it)."""
    return "tool_calls" if calls and reason == "stop" else reason


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def render_prompt(renderer, req, param: str = "messages"):
    """A chat request's prompt (a RenderedChat): its messages and tools with its template controls;
    a chat the template refuses is a 400 naming `param`. (A chat completion's, a /tokenize body's,
    and the fleet's reading of either for its router.)"""
    try:
        return renderer.render(
            req.messages, req.tools, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs
        )
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None


class ChatFormat:
    """A chat request's response and chunk objects; its tool-call syntax and callable functions
    (chat requests with tools, unless tool_choice is 'none')."""

    def __init__(self, model: str, req: ChatCompletionRequest, tokenizer, renderer):
        self.head, self.tokenizer = ResponseHead("chatcmpl", model), tokenizer
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.skip_special = req.skip_special_tokens  # the log-probs' token texts follow the output text
        self.max_calls = 1 if req.parallel_tool_calls is False else None
        self.tool_format: ToolFormat | None = None
        self.tool_names: frozenset[str] | None = None
        if req.tools and req.tool_choice != "none" and renderer.tool_format:
            self.tool_format = renderer.tool_format
            self.tool_names = frozenset(f["name"] for f in tool_functions(req))  # (each a string: checked there)
        self._parsers: dict[int, ToolCallParser | None] = {}  # choice index -> its stream's parser (None: no tools)

    def parser(self) -> ToolCallParser | None:
        """A fresh parser of a streamed choice's tool calls (None when the request has no tools)."""
        return ToolCallParser(self.tool_format, self.tool_names, self.max_calls) if self.tool_format else None

    def logprobs(self, entries) -> ChatLogprobs | None:
        """OpenAI's logprobs object for generated tokens. A token's text is its own decoding (U+FFFD
        for a piece of a multi-byte character, as OpenAI's API shows it) and `bytes` carry its real
        bytes. A sampled special token shows as the output text shows it (skip_special_tokens); an
        alternative always by its own text, as vLLM names it, or a client could not tell which one
        it was."""
        if not entries:
            return None
        tok, skip = self.tokenizer, self.skip_special

        def one(t, skip_special) -> dict:
            return {
                "token": tok.decode([t], skip_special_tokens=skip_special),
                "bytes": list(tok.token_bytes(t, skip_special)),
            }

        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    **one(e.token, skip),
                    logprob=e.logprob,
                    top_logprobs=[TopLogprob(**one(t, False), logprob=v) for t, v in e.top],
                )
                for e in entries
            ]
        )

    def message(self, event: Finished) -> tuple[ChatMessage, str]:
        """The assistant message of a finished choice, and its finish reason."""
        if self.tool_format is None:
            return ChatMessage(content=event.text), event.finish_reason
        content, calls = parse_all(self.tool_format, event.text, self.tool_names, self.max_calls)
        if not calls:
            return ChatMessage(content=content), event.finish_reason
        tool_calls = [ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
        return ChatMessage(content=content, tool_calls=tool_calls), with_calls(event.finish_reason, calls)

    def finish_reason(self, event: Finished) -> str:
        """The finish reason a finished job's client is sent, for /metrics to count the same (run on
        the engine thread: a chat answer's tool calls are parsed there once more)."""
        if self.tool_format is None or event.finish_reason != "stop":
            return event.finish_reason
        return with_calls(
            event.finish_reason, parse_all(self.tool_format, event.text, self.tool_names, self.max_calls)[1]
        )

    def response(self, events: list[Finished], prompts: int = 1) -> ChatCompletionResponse:
        choices = []
        for i, e in enumerate(events):
            message, reason = self.message(e)
            choices.append(
                ChatCompletionChoice(index=i, message=message, logprobs=self.logprobs(e.logprobs), finish_reason=reason)
            )
        return ChatCompletionResponse(**self.head.fields(), choices=choices, usage=usage_of(events, prompts))

    # -- streamed (serving_base.OpenAIServing.stream's ChunkWriter) -------------------------

    @staticmethod
    def tool_delta(event: ToolEvent) -> DeltaMessage:
        """A ToolCallParser event as a delta: content, a call's start (id, name), its arguments."""
        if isinstance(event, Content):
            return DeltaMessage(content=event.text)
        if isinstance(event, CallStart):
            return DeltaMessage(
                tool_calls=[
                    DeltaToolCall(
                        index=event.index,
                        id=call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=event.name, arguments=""),
                    )
                ]
            )
        return DeltaMessage(
            tool_calls=[DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text))]
        )

    def _chunk(self, delta: DeltaMessage, index: int, finish_reason: str | None = None, logprobs=()) -> str:
        choice = ChatCompletionStreamChoice(
            index=index, delta=delta, logprobs=self.logprobs(logprobs), finish_reason=finish_reason
        )
        return sse(
            ChatCompletionChunk(**self.head.fields(), choices=[choice]),
            exclude=None if self.include_usage else {"usage"},
        )

    def opening(self, choices: int) -> list[str]:
        self._parsers = {i: self.parser() for i in range(choices)}
        return [self._chunk(DeltaMessage(role="assistant", content=""), i) for i in range(choices)]

    def event(self, index: int, event) -> list[str]:
        parser = self._parsers.get(index)
        if isinstance(event, Delta):
            if parser is None:
                return [self._chunk(DeltaMessage(content=event.text), index, logprobs=event.logprobs)]
            # tool calls: the parser decides what the text is
            deltas = [self.tool_delta(e) for e in parser.feed(event.text)] or (
                [DeltaMessage()] if event.logprobs else []
            )
            return [self._chunk(d, index, logprobs=event.logprobs if k == 0 else ()) for k, d in enumerate(deltas)]
        reason, out = event.finish_reason, []
        if parser is not None:
            out = [self._chunk(self.tool_delta(e), index) for e in parser.finish()]
            reason = with_calls(reason, parser.calls)
        return out + [self._chunk(DeltaMessage(), index, reason)]

    def usage(self, events: list[Finished], prompts: int = 1) -> str:
        return sse(ChatCompletionChunk(**self.head.fields(), choices=[], usage=usage_of(events, prompts)))


class OpenAIServingChat(OpenAIServing):
    request_model: type[BaseModel] = ChatCompletionRequest  # (the Responses endpoint's subclass parses another)
    names = FieldNames(prompt="messages")

    async def create(self, request: Request):
        state = self.state
        req = await self.parsed(request)
        jobs = await state.prepare(request, self.prepare, request, req)
        fmt = ChatFormat(state.model_name, req, state.tokenizer, state.renderer)
        if len(jobs) == 1:
            channel = await self.submit(jobs[0])
            stream = (lambda first: self.stream(jobs, channel, fmt, (0, first))) if req.stream else None
            return await self.answer_one(
                request, jobs[0], channel, stream, lambda event: self.json_response(request, fmt.response, [event])
            )
        merged = Merged() if req.stream else None
        channels = await self.submit_all(jobs, merged)
        if merged is not None:  # (streamed)
            return StreamingResponse(self.stream(jobs, merged, fmt), media_type="text/event-stream")
        events = await self.finish_all(request, jobs, channels)
        if events is None:
            return JSONResponse({}, status_code=499)
        return await self.json_response(request, fmt.response, events)

    def prepare(self, request: Request, req: ChatCompletionRequest, names: FieldNames | None = None) -> list[Job]:
        """The request's jobs (on a worker thread): its `n` choices. `names`: what the request's fields
        are called in errors (the Responses API's, when it comes from there)."""
        state, names = self.state, names or self.names
        check_supported(req, names.prompt)
        check_text_only(req, names.prompt)
        state.check_model(req.model)
        # before the tools' constraint is built or anything is tokenized: their schemas are rendered too
        state.check_text(text_chars(req.messages) + text_chars(req.tools), names.prompt, names.prompt)
        constraint, asked_by = constraint_of(req, names.response_format)
        functions = tool_functions(req)
        tool_format, forced = state.renderer.tool_format, req.tool_choice not in (None, "auto", "none")
        if tool_format and functions and req.tool_choice != "none":
            parallel = req.parallel_tool_calls is not False
            if asked_by == names.response_format:  # a format for text turns: calls stay possible
                constraint = tool_constraint(
                    tool_format, functions, req.tool_choice, state.tokenizer.added_token_id, parallel, text=constraint
                )
            elif forced:  # (vLLM's guided_* fields constrain the whole output, as a forced call does)
                if constraint is not None:
                    raise APIError(
                        400,
                        f"tool_choice={req.tool_choice!r} and {asked_by} both constrain the output; set only one",
                        param=asked_by,
                    )
                constraint = tool_constraint(
                    tool_format, functions, req.tool_choice, state.tokenizer.added_token_id, parallel
                )
            if forced:
                asked_by = "tool_choice"
        rendered = render_prompt(state.renderer, req, names.prompt)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        fmt = ChatFormat(state.model_name, req, state.tokenizer, state.renderer)
        prompts = Prompts([rendered.token_ids], requested, constraint, asked_by, rendered.segment_starts)
        return self.jobs(request, req, prompts, fmt.finish_reason, names)
