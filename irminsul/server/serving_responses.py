"""POST /v1/responses: OpenAI's Responses API, stateless, on the chat path.

Newer agent SDKs speak this API by default. A request's `instructions` and `input` items become
chat messages (a `function_call` item is an assistant tool call, a `function_call_output` item the
tool's answer), its function tools and `text.format` become the chat request's `tools` and
`response_format`, and from there it is a chat completion: the checkpoint's template, the same
reuse, the same tool-call parser and grammar-forced `tool_choice`. The answer is a `response`
object whose `output` holds a `message` item for text and a `function_call` item per call;
streamed, it is the API's typed events (`response.created` ... `response.output_text.delta` ...
`response.function_call_arguments.delta` ... `response.completed`).

Stateless: nothing is stored, so `previous_response_id`, `conversation`, `background` and item
references are refused with a 400 that says so; send the whole conversation as `input`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import Request

from irminsul.server.body import validated
from irminsul.server.engine_client import Delta, Finished, Job
from irminsul.server.errors import APIError
from irminsul.server.limits import MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE
from irminsul.server.protocol import ChatCompletionRequest, ChatTokenLogprob, GenerationRequest
from irminsul.server.protocol_responses import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    IncompleteDetails,
    OutputItemEvent,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    ResponseEvent,
    ResponseFunctionCall,
    ResponseLifecycleEvent,
    ResponseMessage,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from irminsul.server.serving_base import FieldNames
from irminsul.server.serving_chat import ChatFormat, OpenAIServingChat, call_id
from irminsul.server.tools import CallStart, Content, ToolEvent
from irminsul.server.translate import NON_TEXT_PARTS, usage

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# chat fields a Responses request may also carry (vLLM accepts its sampling extensions here too)
_PASSED = set(GenerationRequest.model_fields) - {
    "max_tokens",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "response_format",
    "best_of",
}


def _refuse(req: ResponsesRequest) -> None:
    checks = [
        (
            "previous_response_id",
            req.previous_response_id is not None,
            "this server is stateless: previous_response_id is not supported; send the whole conversation as input",
        ),
        (
            "conversation",
            req.conversation is not None,
            "this server is stateless: conversation is not supported; send the whole conversation as input",
        ),
        ("background", bool(req.background), "background responses are not supported"),
        (
            "reasoning",
            bool(req.reasoning and req.reasoning.get("effort") not in (None, "none", "minimal")),
            "reasoning effort is not supported: the served model does not reason",
        ),
        (
            "truncation",
            req.truncation not in (None, "disabled"),
            "truncation='auto' is not supported; a conversation longer than the context is refused",
        ),
        (
            "include",
            any(i != LOGPROBS_INCLUDE for i in req.include or []),
            f"include supports only {LOGPROBS_INCLUDE!r}",
        ),
    ]
    for param, bad, message in checks:
        if bad:
            raise APIError(400, message, param=param)
    metadata = req.metadata or {}  # (its number of pairs, input's items and tools: check_sizes)
    if any(
        len(k) > MAX_METADATA_KEY or not isinstance(v, str) or len(v) > MAX_METADATA_VALUE for k, v in metadata.items()
    ):
        raise APIError(
            400,
            f"metadata takes at most {MAX_METADATA} pairs, keys of at most {MAX_METADATA_KEY} "
            f"characters and string values of at most {MAX_METADATA_VALUE}",
            param="metadata",
        )


def _text(content, where: str) -> str:
    """A message's content: a string or a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", param=where)
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"{where}.content[{k}] is a {kind!r} part: this model takes text only (parts of "
                f"type input_text, output_text)",
                param=f"{where}.content[{k}].type",
                code="unsupported_content" if kind in NON_TEXT_PARTS else None,
            )
        out.append(part["text"])
    return "".join(out)


def to_messages(req: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` as chat messages."""
    messages: list[dict] = []
    calls: set[str] = set()  # call ids of the function_call items so far
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer", param=where)
            messages.append(
                {"role": "system" if role == "developer" else role, "content": _text(item.get("content"), where)}
            )
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(
                    400, f"{where}: a function_call needs call_id, name and arguments (strings)", param=where
                )
            calls.add(item["call_id"])
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls of one turn: one assistant message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise APIError(400, f"{where}: a function_call_output needs call_id and output", param=where)
            if item["call_id"] not in calls:  # (stateless: the call must be in this input, before its output)
                raise APIError(
                    400,
                    f"{where}: no function_call with call_id {item['call_id']!r} comes before this output in input",
                    param=where,
                )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": output if isinstance(output, str) else _text(output, where),
                }
            )
        elif kind == "reasoning":
            continue  # another model's reasoning summary: nothing this model's template can show
        else:
            raise APIError(
                400,
                f"{where} is a {kind!r} item; this server takes message, function_call and function_call_output items",
                param=where,
            )
    if not messages:
        raise APIError(
            400,
            "input holds nothing to answer: no message, function call or function call output "
            "(reasoning items are skipped)",
            param="input",
        )
    return messages


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    _refuse(req)
    body: dict[str, Any] = {k: v for k, v in (req.model_extra or {}).items() if k in _PASSED}
    body.update(
        model=req.model,
        messages=to_messages(req),
        temperature=req.temperature,
        top_p=req.top_p,
        max_completion_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls,
    )
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise APIError(
                    400, f"tools[{i}] is a {kind!r} tool; this server runs function tools only", param=f"tools[{i}]"
                )
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise APIError(
                    400, f"tools[{i}]: a function tool needs a name (a non-empty string)", param=f"tools[{i}]"
                )
            tools.append(
                {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
            )
        body["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(
                400,
                "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                param="tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    body["tool_choice"] = choice
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt},
            }
        elif kind == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif kind != "text":
            raise APIError(400, "text.format.type must be text, json_object or json_schema", param="text.format")
    if req.top_logprobs is not None or LOGPROBS_INCLUDE in (req.include or []):
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    return validated(ChatCompletionRequest, body)  # (a passed-through chat field may be bad: a 400)


class ResponsesBuilder:
    """The response object and its stream of events, built from the chat path's events."""

    def __init__(self, req: ResponsesRequest, fmt: ChatFormat, model: str):
        self.req, self.fmt, self.model = req, fmt, model
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.output: list = []
        self.seq = 0
        self.open: ResponseMessage | ResponseFunctionCall | None = None  # the item being streamed

    def response(self, status: str, finished: Finished | None = None) -> ResponseObject:
        req = self.req
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            status=status,
            model=self.model,
            output=self.output,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            metadata=req.metadata or {},
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            tools=req.tools or [],
            tool_choice=req.tool_choice or "auto",
            text=req.text or {"format": {"type": "text"}},
            usage=None if finished is None else ResponseUsage.of(usage(finished.stats, finished.completion_tokens)),
        )

    @staticmethod
    def status(finished: Finished) -> str:
        return "incomplete" if finished.finish_reason == "length" else "completed"

    # -- whole ------------------------------------------------------------------------------

    def whole(self, finished: Finished) -> ResponseObject:
        message, _ = self.fmt.message(finished)
        if message.content:
            self.output.append(self._message(message.content, "completed", self.logprobs(finished.logprobs)))
        for call in message.tool_calls or ():
            self.output.append(
                ResponseFunctionCall(
                    id=f"fc_{uuid.uuid4().hex}",
                    call_id=call.id,
                    name=call.function.name,
                    arguments=call.function.arguments,
                    status="completed",
                )
            )
        if self.output:  # the item being written when max_output_tokens cut it off (OpenAI marks it so)
            self.output[-1].status = self.status(finished)
        return self.response(self.status(finished), finished)

    def logprobs(self, entries) -> list[ChatTokenLogprob]:
        lp = self.fmt.logprobs(entries) if entries else None
        return lp.content if lp else []

    @staticmethod
    def _message(text: str, status: str, logprobs: list) -> ResponseMessage:
        return ResponseMessage(
            id=f"msg_{uuid.uuid4().hex}", status=status, content=[OutputText(text=text, logprobs=logprobs)]
        )

    # -- streamed ---------------------------------------------------------------------------

    def event(self, kind: type[ResponseEvent], type: str, **fields) -> str:
        body = kind(type=type, sequence_number=self.seq, **fields)
        self.seq += 1
        return f"event: {type}\ndata: {json.dumps(body.model_dump(), ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        r = self.response("in_progress")
        return [
            self.event(ResponseLifecycleEvent, "response.created", response=r),
            self.event(ResponseLifecycleEvent, "response.in_progress", response=r),
        ]

    def piece(self, event: ToolEvent, logprobs: list) -> list[str]:
        """Events for one ToolCallParser event: text, a call's start, its arguments."""
        if isinstance(event, Content):
            return self.text(event.text, logprobs) if event.text else []
        return self.call(event.name) if isinstance(event, CallStart) else self.arguments(event.text)

    def text(self, piece: str, logprobs: list) -> list[str]:
        out, index = [], len(self.output)
        if not isinstance(self.open, ResponseMessage):  # (events are serialized as they are made)
            out += self.close()
            index = len(self.output)
            self.open = self._message("", "in_progress", [])
            out.append(
                self.event(
                    OutputItemEvent,
                    "response.output_item.added",
                    output_index=index,
                    item=self.open.model_copy(update={"content": []}),
                )
            )
            out.append(
                self.event(
                    ContentPartEvent,
                    "response.content_part.added",
                    item_id=self.open.id,
                    output_index=index,
                    content_index=0,
                    part=self.open.content[0],
                )
            )
        part = self.open.content[0]
        part.text += piece
        part.logprobs = part.logprobs + list(logprobs)
        out.append(
            self.event(
                OutputTextDeltaEvent,
                "response.output_text.delta",
                item_id=self.open.id,
                output_index=index,
                content_index=0,
                delta=piece,
                logprobs=logprobs,
            )
        )
        return out

    def call(self, name: str) -> list[str]:
        out = self.close()
        self.open = ResponseFunctionCall(
            id=f"fc_{uuid.uuid4().hex}", call_id=call_id(), name=name, arguments="", status="in_progress"
        )
        out.append(
            self.event(OutputItemEvent, "response.output_item.added", output_index=len(self.output), item=self.open)
        )
        return out

    def arguments(self, piece: str) -> list[str]:
        # a call's arguments come after its CallStart (ToolCallParser), which opened its item
        assert isinstance(self.open, ResponseFunctionCall)
        self.open.arguments += piece
        return [
            self.event(
                ArgumentsDeltaEvent,
                "response.function_call_arguments.delta",
                item_id=self.open.id,
                output_index=len(self.output),
                delta=piece,
            )
        ]

    def close(self, status: str = "completed") -> list[str]:
        """Finish the open item; `status`: "incomplete" for the one max_output_tokens cut off."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, out = len(self.output), []
        item.status = status
        if isinstance(item, ResponseMessage):
            part = item.content[0]
            out.append(
                self.event(
                    OutputTextDoneEvent,
                    "response.output_text.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=part.text,
                    logprobs=part.logprobs,
                )
            )
            out.append(
                self.event(
                    ContentPartEvent,
                    "response.content_part.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        else:
            out.append(
                self.event(
                    ArgumentsDoneEvent,
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        out.append(self.event(OutputItemEvent, "response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return out

    def end(self, finished: Finished) -> list[str]:
        status = self.status(finished)
        out = self.close(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self.event(ResponseLifecycleEvent, kind, response=self.response(status, finished))]


class OpenAIServingResponses(OpenAIServingChat):
    """The Responses API on the chat path: the request becomes a chat request, its jobs are the chat
    path's (with errors in the Responses API's field names), its events become Responses objects."""

    request_model = ResponsesRequest
    names = FieldNames(prompt="input", max_tokens="max_output_tokens", response_format="text.format")

    async def create(self, request: Request):
        state = self.state
        req = await self.parsed(request)
        chat, (job,) = await state.prepare(request, self._jobs, request, req)
        channel = await self.submit(job)
        build = ResponsesBuilder(
            req, ChatFormat(state.model_name, chat, state.tokenizer, state.renderer), state.model_name
        )
        stream = (lambda first: self._stream(request, job, channel, build, first)) if req.stream else None
        return await self.answer_one(
            request, job, channel, stream, lambda finished: self.json_response(request, build.whole, finished)
        )

    def _jobs(self, request: Request, req: ResponsesRequest) -> tuple[ChatCompletionRequest, list[Job]]:
        """The chat request and its job (on a worker thread: converting the input is proportional to it)."""
        chat = to_chat(req)
        return chat, self.prepare(request, chat, self.names)

    async def _stream(self, request: Request, job: Job, channel, build: ResponsesBuilder, first):
        parser = build.fmt.parser()
        done = False
        # log-probs of text not yet sent: they go with the text, not with calls, and the tool-call
        # parser may hold text back until it knows which it is
        pending: list = []

        def pieces_out(pieces):
            nonlocal pending
            for piece in pieces:
                lines = build.piece(piece, pending if isinstance(piece, Content) else [])
                if lines:
                    pending = []  # sent with the text, or the text was a call's
                yield from lines

        try:
            # the lifecycle events carry the whole response object (tools, instructions): built off the loop
            for line in await self.state.prepare(request, build.start):
                yield line
            event = first
            while True:
                if isinstance(event, Delta):
                    pending = pending + build.logprobs(event.logprobs)
                    for line in pieces_out(parser.feed(event.text) if parser is not None else [Content(event.text)]):
                        yield line
                elif isinstance(event, Finished):
                    for line in pieces_out(parser.finish() if parser is not None else []):
                        yield line
                    for line in await self.state.prepare(request, build.end, event):
                        yield line
                    break
                else:
                    err = APIError(event.status, event.message)
                    yield build.event(ErrorEvent, "error", code=err.code, message=err.message, param=err.param)
                    break
                _, event = await channel.get()
            done = True
        finally:
            if not done:
                self.client.abort(job)
