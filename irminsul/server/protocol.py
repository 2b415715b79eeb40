"""The OpenAI wire format: request and response models, validation into engine parameters, errors, usage.

Behaviour follows OpenAI's API and vLLM's server where they agree: unknown fields are ignored
(agent frameworks send many), but a field we know and cannot honour (``best_of``, ``suffix``,
``chat_template_kwargs`` ...) is a 400 that names it. Errors use OpenAI's body:
``{"error": {"message", "type", "param", "code"}}``.

Responses are built from the models below and sent as ``model_dump()`` gives them: a field is
null when OpenAI's API sends null, and absent when it leaves the field out (a model's
``absent_if_none`` names those: a delta's unset parts, a message without tool calls).
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_serializer, model_validator
from starlette.requests import ClientDisconnect

from irminsul.engine.grammar import Constraint
from irminsul.engine.grammar_limits import MAX_OPTIONS, parse_json
from irminsul.engine.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from irminsul.engine.sequence import RequestStats
from irminsul.errors import RequestError


class APIError(Exception):
    """An answer other than 200, with OpenAI's error body. `retry_after`: seconds, sent as Retry-After
    (a 429 or 503 a retry may turn into a 200)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                             404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
                             503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    @property
    def headers(self) -> dict | None:
        return None if self.retry_after is None else {"Retry-After": str(self.retry_after)}


def context_exceeded(context: int, detail: str, param: str | None, what: str = "messages") -> APIError:
    """A request longer than the context, in OpenAI's words and code: clients key on them (litellm's
    ContextWindowExceededError, LangChain's context-overflow error) to shorten instead of retrying."""
    return APIError(400, f"This model's maximum context length is {context} tokens. However, {detail}. "
                         f"Please reduce the length of the {what}.", param=param, code="context_length_exceeded")


def _no_bool(value):
    # NOTE: JSON true is not the number 1: pydantic's lax mode would take it as one
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


def _no_bools(value):
    if isinstance(value, list) and any(isinstance(v, bool) for v in value):
        raise ValueError("must hold integers, not booleans")
    return value


Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool)]
IntList = Annotated[list[int], BeforeValidator(_no_bools)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None  # vLLM/SGLang extension
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: IntList | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    n: Int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # vLLM: the request's cache namespace
    best_of: int | None = None  # only 1 (refused otherwise)
    logprobs: bool | Int | None = None  # chat: true/false; completions: the number of alternatives
    top_logprobs: Int | None = None
    logit_bias: dict | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    # vLLM extensions
    repetition_penalty: Float | None = None
    min_tokens: Int | None = None
    min_p: Float | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool = True
    # structured output: at most one of these (OpenAI's response_format, vLLM's older guided_* and
    # newer structured_outputs)
    response_format: dict | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None


class ChatCompletionRequest(_Common):
    messages: list[Any]
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (forced: exactly one)
    max_completion_tokens: Int | None = None
    add_generation_prompt: bool = True  # vLLM's chat-template controls
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class CompletionRequest(_Common):
    prompt: str | IntList | list[str] | list[IntList]
    echo: bool = False
    suffix: str | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_logprobs: Int | None = None
    include: list[str] | None = None
    text: dict | None = None
    stream: bool = False
    metadata: dict | None = None
    store: bool | None = None  # accepted; nothing is stored (the response says store: false)
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    reasoning: dict | None = None
    truncation: str | None = None


MAX_DEPTH = 64  # nesting of JSON arrays and objects a request may use
# Each is far beyond what a client needs and bounds the work one request can make for everyone
# (a million stop strings once slowed every request 25x: they are checked at every token).
MAX_STOP, MAX_STOP_CHARS = 16, 1024
MAX_MESSAGES, MAX_TOOLS, MAX_PARTS = 4096, 512, 16384  # MAX_PARTS: content parts in all a request's messages
MAX_CHOICES = 64  # n x prompts of one request
# OpenAI's bounds on metadata (it is echoed into the response and three of its stream events)
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_TEMPLATE_KWARGS = 64  # entries of chat_template_kwargs
# How many items each list- or map-valued field may hold, checked on the decoded JSON before
# anything walks it (validation holds Python's lock: a million items of an 8 MiB body are seconds
# in which no other thread runs). Fields of token ids are bounded by the context (`check_sizes`).
SIZE_BOUNDS = {"messages": MAX_MESSAGES, "input": MAX_MESSAGES, "tools": MAX_TOOLS, "stop": MAX_STOP,
               "stop_token_ids": MAX_STOP, "logit_bias": MAX_LOGIT_BIAS, "metadata": MAX_METADATA,
               "guided_choice": MAX_OPTIONS, "include": 16, "chat_template_kwargs": MAX_TEMPLATE_KWARGS}
ID_FIELDS = ("tokens", "token_ids")  # /detokenize's and publishing's


async def read_body(request, limit: int) -> bytes:
    """The request body, refused with a 413 as soon as it is larger than `limit` bytes: by its
    Content-Length before anything is read, else as it streams in."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {int(declared)} bytes; this server takes at most {limit} "
                            f"(--max-request-bytes)")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is over {limit} bytes (--max-request-bytes)")
            chunks.append(chunk)
    except ClientDisconnect:  # nobody to answer: counted as a 499 (nginx's "client closed"), not an error log
        raise APIError(499, "the client went away before it sent the whole request body") from None
    return b"".join(chunks)


def check_values(value, path: str = "", depth: int = 0) -> None:
    """Refuse what JSON can carry but the engine cannot take: lone surrogates (\\ud800 escapes
    make strings no tokenizer encodes) and deep nesting."""
    if depth > MAX_DEPTH:
        raise APIError(400, f"the request nests deeper than {MAX_DEPTH} levels{f' at {path}' if path else ''}")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{path or 'a string'} holds an unpaired UTF-16 surrogate; send valid Unicode",
                           param=path or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_values(k, path, depth + 1)
            check_values(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_values(v, f"{path}[{i}]", depth + 1)


class PublishRequest(BaseModel):
    """POST /v1/cache/chunks: exactly one of text or token_ids."""

    model: str | None = None
    text: str | None = None
    token_ids: list[int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_document(cls, data):
        if not isinstance(data, dict) or ("text" in data) == ("token_ids" in data):
            raise APIError(400, "send exactly one of 'text' (a string) or 'token_ids' (a list of ints)")
        if "text" in data and (not isinstance(data["text"], str) or not data["text"]):
            raise APIError(400, "'text' must be a non-empty string", param="text")
        ids = data.get("token_ids")
        if "token_ids" in data and not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                      for t in ids)):
            raise APIError(400, "'token_ids' must be a list of integers", param="token_ids")
        return data


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: IntList


def body_schema(model: type[BaseModel]) -> dict:
    """OpenAPI `requestBody` for a route whose handler reads and parses the body itself (the
    model's JSON schema with its definitions inlined, so it stands alone in /openapi.json)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def parse_body(raw: bytes, model: type[BaseModel], context: int | None = None):
    """Raw body -> request model; every failure is a 400 that says what was wrong. `context`: the
    model's, which bounds lists of token ids (None: left to the checks after parsing)."""
    try:
        with _collector_paused():
            data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise APIError(400, f"the request nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_sizes(data, context)
    check_values(data)
    return validated(model, data)


_paused = [0, False]  # parses under way with the collector paused; whether it was on before the first
_paused_lock = threading.Lock()


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while a body is decoded: a body of a million small
    lists makes a million containers, and the collections they set off walk every object the
    process holds, the model's included, several times over, all of it holding Python's lock, so
    the event loop waits too. Nothing decoded can be garbage yet."""
    with _paused_lock:
        _paused[0] += 1
        if _paused[0] == 1:
            _paused[1] = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        with _paused_lock:
            _paused[0] -= 1
            if _paused[0] == 0 and _paused[1]:
                gc.enable()


def check_sizes(data: dict, context: int | None) -> None:
    """Every list- or map-valued field within its bound (SIZE_BOUNDS; token ids within the context),
    counted before anything walks the request: O(its fields)."""
    for field, most in SIZE_BOUNDS.items():
        value = data.get(field)
        if isinstance(value, (list, dict)) and len(value) > most:
            raise APIError(400, f"{field} has {len(value):,} items; at most {most} per request", param=field)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):  # a batch of prompts
        if len(prompt) > MAX_CHOICES:
            raise APIError(400, f"prompt holds {len(prompt):,} prompts; at most {MAX_CHOICES} per request",
                           param="prompt")
        prompt = max((p for p in prompt if isinstance(p, list)), key=len, default=None)
    if context is None:
        return
    for field in ID_FIELDS:
        value = data.get(field)
        if isinstance(value, list) and len(value) > context:
            raise APIError(400, f"{field} holds {len(value):,} ids; at most {context} (the model's context) per "
                                f"request", param=field)
    if isinstance(prompt, list) and len(prompt) >= context:  # (token ids: one position is left to answer)
        raise context_exceeded(context, f"your prompt has {len(prompt):,} tokens (at most {context - 1} leave "
                                        f"room for an answer)", "prompt", "prompt")


def validated(model: type[BaseModel], data: dict):
    """A request model from its fields; a failure is a 400 naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or None
        more = f" (and {len(e.errors()) - 1} more problems)" if len(e.errors()) > 1 else ""
        raise APIError(400, f"{loc}: {err['msg']}{more}", param=loc) from None


def check_supported(req: _Common, messages: str = "messages") -> None:
    """Refuse parameters we know and cannot honour (`messages`: what the request calls a chat's messages)."""
    refuse = [
        ("n", not 1 <= req.n <= MAX_CHOICES, f"n={req.n} must be in [1, {MAX_CHOICES}]"),
        ("best_of", req.best_of not in (None, 1), "best_of is not supported"),
        ("echo", getattr(req, "echo", False) and req.stream, "echo is not supported with stream=true yet"),
        ("stream_options", req.stream_options is not None and not req.stream,
         "stream_options can only be set when stream=true"),
    ]
    if isinstance(req, ChatCompletionRequest):
        top = req.top_logprobs
        refuse += [("top_logprobs", top is not None and not req.logprobs, "top_logprobs needs logprobs=true"),
                   ("top_logprobs", top is not None and not (isinstance(top, int) and 0 <= top <= MAX_TOP_LOGPROBS),
                    f"top_logprobs={top!r} must be an integer in [0, {MAX_TOP_LOGPROBS}]")]
    else:
        refuse += [("suffix", bool(req.suffix), "suffix is not supported"),
                   ("top_logprobs", req.top_logprobs is not None, "top_logprobs is a chat field; completions take "
                                                                  "logprobs=N")]
    for param, bad, message in refuse:
        if bad:
            raise APIError(400, message, param=param, code="unsupported_parameter")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])  # (their number: check_sizes)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each",
                       param="stop")
    if isinstance(req, ChatCompletionRequest):
        if len(req.messages) > MAX_MESSAGES:  # (a Responses request's input, converted)
            raise APIError(400, f"at most {MAX_MESSAGES} messages per request", param=messages)
        if sum(len(m["content"]) for m in req.messages
               if isinstance(m, dict) and isinstance(m.get("content"), list)) > MAX_PARTS:
            raise APIError(400, f"at most {MAX_PARTS} content parts per request (in all its messages)",
                           param=messages)
    if req.cache_salt is not None and not (0 < len(req.cache_salt) <= 256):
        raise APIError(400, "cache_salt must be a non-empty string of at most 256 characters", param="cache_salt")


NON_TEXT_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file", "input_file", "video_url")


def check_text_only(req: ChatCompletionRequest, messages: str = "messages") -> None:
    """The served model reads and writes text only: image, audio and file parts, an audio output
    and non-text modalities are refused with the field named, never ignored."""
    extra = req.model_extra or {}
    modalities = extra.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise APIError(400, f"modalities={modalities!r}: this model produces text only; send ['text'] or leave it "
                            f"out", param="modalities", code="unsupported_parameter")
    if extra.get("audio") is not None:
        raise APIError(400, "audio output is not supported: this model produces text only", param="audio",
                       code="unsupported_parameter")
    for i, m in enumerate(req.messages):
        if not isinstance(m, dict):
            continue
        if m.get("audio") is not None:
            raise APIError(400, f"{messages}[{i}].audio: this model takes text only", param=f"{messages}[{i}].audio",
                           code="unsupported_content")
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in NON_TEXT_PARTS:
                where = f"{messages}[{i}].content[{j}]"
                raise APIError(400, f"{where} is an {kind!r} part: this model takes text only (parts of type "
                                    f"'text')", param=f"{where}.type", code="unsupported_content")


def requested_logprobs(req: _Common) -> int | None:
    """None (off) or how many alternatives per token: chat says logprobs=true + top_logprobs=N,
    completions logprobs=N."""
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs is not None and not isinstance(req.logprobs, bool):
            raise APIError(400, "logprobs must be true or false for chat completions", param="logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    if req.logprobs is None or req.logprobs is False:
        return None
    if isinstance(req.logprobs, bool) or not isinstance(req.logprobs, int):
        raise APIError(400, "logprobs must be an integer (the number of alternatives) for completions", param="logprobs")
    return req.logprobs


def _logit_bias(bias: dict | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id as a string": bias} -> ((id, bias), ...); at most MAX_LOGIT_BIAS entries,
    counted before any is read."""
    if len(bias or {}) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                       param="logit_bias")
    out = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise APIError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise APIError(400, f"logit_bias[{key!r}] must be a number", param="logit_bias")
        out.append((token, float(value)))
    return tuple(out)


def constraint_of(req: _Common, response_format: str = "response_format") -> tuple[Constraint | None, str | None]:
    """The structured-output constraint a request asks for, and the field that asked (for errors;
    `response_format`: what the request calls that field)."""
    asked = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            asked.append((response_format, lambda: Constraint.json_schema(None)))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise APIError(400, f"{response_format} type 'json_schema' needs json_schema.schema, a JSON schema "
                                    f"object", param=response_format)
            asked.append((response_format, lambda: Constraint.json_schema(schema)))
        elif kind != "text":
            raise APIError(400, f"{response_format} type {kind!r} must be one of 'text', 'json_object', "
                                f"'json_schema'", param=response_format)
    so = req.structured_outputs or {}
    if not isinstance(so, dict):
        raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
    for name, value, make in (
        ("guided_json", req.guided_json, _json_constraint), ("guided_regex", req.guided_regex, Constraint.regex),
        ("guided_choice", req.guided_choice, Constraint.choice), ("guided_grammar", req.guided_grammar, Constraint.lark),
        ("structured_outputs.json", so.get("json"), _json_constraint),
        ("structured_outputs.regex", so.get("regex"), Constraint.regex),
        ("structured_outputs.choice", so.get("choice"), Constraint.choice),
        ("structured_outputs.grammar", so.get("grammar"), Constraint.lark),
    ):
        if value is not None:
            asked.append((name, lambda make=make, value=value: make(value)))
    if not asked:
        return None, None
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(n for n, _ in asked)} each constrain the output; set only one",
                       param=asked[1][0])
    name, make = asked[0]
    try:
        return make(), name
    except RequestError as e:
        raise APIError(400, f"{name}: {e}", param=name) from None


def _json_constraint(value) -> Constraint:
    if isinstance(value, str):  # vLLM takes the schema as JSON text too
        value = parse_json(value, "the schema")
    return Constraint.json_schema(value)


def tool_functions(req: ChatCompletionRequest) -> list[dict]:
    """The request's functions ({"name", "parameters", ...}) after checking them and tool_choice."""
    functions = [_function(i, t) for i, t in enumerate(req.tools or [])]
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return functions
    if choice == "required":
        named = None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        named = choice["function"]["name"]
    else:
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if not functions:
        raise APIError(400, f"tool_choice={choice!r} needs tools", param="tool_choice")
    if named is not None and named not in [f.get("name") for f in functions]:
        raise APIError(400, f"tool_choice names the function {named!r}, which is not among the tools",
                       param="tool_choice")
    return functions


def _function(i: int, tool) -> dict:
    """tools[i]'s function: {"type": "function", "function": {"name": ..., "parameters": {...}}}
    (or the function object itself, as some clients send it)."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise APIError(400, f"{where} must be an object {{'type': 'function', 'function': {{'name': ...}}}}",
                       param=where)
    if tool.get("type", "function") != "function":
        raise APIError(400, f"{where}.type is {tool['type']!r}; only 'function' tools are supported", param=where)
    fn = tool.get("function", tool)
    if "function" in tool:
        where += ".function"
    if not isinstance(fn, dict):
        raise APIError(400, f"{where} must be an object with a name (and parameters, a JSON schema), "
                            f"not {type(fn).__name__}", param=where)
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise APIError(400, f"{where}.name must be a non-empty string", param=where)
    if not isinstance(fn.get("parameters", {}) or {}, dict):
        raise APIError(400, f"{where}.parameters must be a JSON schema object, not "
                            f"{type(fn['parameters']).__name__}", param=where)
    return fn


def sampling_params(req: _Common, max_tokens: int, constraint: Constraint | None = None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=requested_logprobs(req),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias),
            min_p=req.min_p or 0.0,
            min_tokens=req.min_tokens or 0,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            skip_special_tokens=req.skip_special_tokens,
            constraint=constraint,
        )
    except RequestError as e:
        name = str(e).split("=", 1)[0]
        raise APIError(400, str(e), param=name if name.isidentifier() else None) from None


def resolve_max_tokens(requested: int | None, prompt_tokens: int, context: int, default: int,
                       name: str = "max_tokens") -> int:
    """vLLM's rule: an explicit max_tokens (the request's field `name`) must fit the context; a
    missing one is capped by it."""
    room = context - prompt_tokens
    if requested is None:
        return max(1, min(default, room))
    if requested < 1:
        raise APIError(400, f"{name}={requested} must be at least 1", param=name)
    if requested > room:
        raise context_exceeded(context, f"you requested {prompt_tokens + requested} tokens ({prompt_tokens} in the "
                                        f"prompt, {requested} in the completion: {name}={requested}, at most "
                                        f"{room} fit)", name, "prompt or completion")
    return requested


def usage(stats: RequestStats, completion_tokens: int) -> UsageInfo:
    """OpenAI usage; cached_tokens = prefix + reused, split in the ``irminsul`` block."""
    return UsageInfo(
        prompt_tokens=stats.prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=stats.prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.prefix_tokens + stats.reused_tokens),
        irminsul=IrminsulUsage(prefix_tokens=stats.prefix_tokens, reused_tokens=stats.reused_tokens,
                               carve_out_tokens=stats.carve_out_tokens, computed_tokens=stats.computed_tokens,
                               s1_tokens=stats.s1_tokens))


def summed_usage(parts: list[UsageInfo]) -> UsageInfo:
    """Field by field sum of usage objects (nested blocks too)."""
    def add(values: list[dict]) -> dict:
        return {k: add([v[k] for v in values]) if isinstance(x, dict) else sum(v[k] for v in values)
                for k, x in values[0].items()}

    return UsageInfo.model_validate(add([p.model_dump() for p in parts]))


# -- responses ---------------------------------------------------------------------------------


class _Wire(BaseModel):
    absent_if_none: ClassVar[tuple[str, ...]] = ()  # fields left out of the body when None (not null)

    @model_serializer(mode="wrap")
    def _leave_out(self, handler):
        out = handler(self)
        for name in self.absent_if_none:
            if out.get(name, 0) is None:
                del out[name]
        return out


class ErrorInfo(_Wire):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Wire):
    error: ErrorInfo


class PromptTokensDetails(_Wire):
    cached_tokens: int


class IrminsulUsage(_Wire):
    """Where the prompt's rows came from: a prefix hit, reused chunks (their carve-out and S1
    tokens recomputed), or computed."""

    prefix_tokens: int
    reused_tokens: int
    carve_out_tokens: int
    computed_tokens: int
    s1_tokens: int


class UsageInfo(_Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    irminsul: IrminsulUsage


class TopLogprob(_Wire):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Wire):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(_Wire):
    """The legacy completions' parallel lists (an echoed prompt's first token has no log-prob)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCall(_Wire):
    name: str
    arguments: str


class ToolCall(_Wire):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Wire):
    absent_if_none = ("tool_calls",)
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(_Wire):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Wire):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(_Wire):
    absent_if_none = ("name",)
    name: str | None = None
    arguments: str


class DeltaToolCall(_Wire):
    """A call's first delta names it (id, type, name); the ones after carry its arguments."""

    absent_if_none = ("id", "type")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Wire):
    absent_if_none = ("role", "content", "tool_calls")
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(_Wire):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Wire):
    """`usage` is null on every chunk but the last when the client asked for it (stream_options),
    absent when it did not: the serving code leaves it out then."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionChoice(_Wire):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Wire):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(_Wire):
    """As ChatCompletionChunk: `usage` is left out unless the client asked for it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(_Wire):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Wire):
    prompt: str


class PublishResponse(_Wire):
    object: Literal["cache.chunks"] = "cache.chunks"
    tokens: int  # of the document
    entries: int  # chunk entries stored
    stored_tokens: int
    skipped: int
    rejected: int


class ModelCard(_Wire):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "irminsul"
    max_model_len: int
    irminsul: dict  # {"reuse": mode, "store": [tier specs]}


class ModelList(_Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- the Responses API ---------------------------------------------------------------------------


class OutputText(_Wire):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class ResponseMessage(_Wire):
    type: Literal["message"] = "message"
    id: str
    status: str
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ResponseFunctionCall(_Wire):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = Annotated[ResponseMessage | ResponseFunctionCall, Field(discriminator="type")]


class OutputTokensDetails(_Wire):
    reasoning_tokens: int = 0


class ResponseUsage(_Wire):
    input_tokens: int
    input_tokens_details: PromptTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int
    irminsul: IrminsulUsage

    @classmethod
    def of(cls, u: UsageInfo) -> ResponseUsage:
        return cls(input_tokens=u.prompt_tokens, input_tokens_details=u.prompt_tokens_details,
                   output_tokens=u.completion_tokens, total_tokens=u.total_tokens, irminsul=u.irminsul)


class IncompleteDetails(_Wire):
    reason: str


class ResponseObject(_Wire):
    """A response as the stateless server gives it (store false, no previous response)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str  # in_progress, completed, incomplete
    model: str
    output: list[OutputItem]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    tools: list
    tool_choice: str | dict
    text: dict
    store: bool = False
    previous_response_id: None = None
    reasoning: None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None


class ResponseEvent(_Wire):
    type: str
    sequence_number: int


class ResponseLifecycleEvent(ResponseEvent):  # response.created, .in_progress, .completed, .incomplete
    response: ResponseObject


class OutputItemEvent(ResponseEvent):  # response.output_item.added, .done
    output_index: int
    item: OutputItem


class ContentPartEvent(ResponseEvent):  # response.content_part.added, .done
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(ResponseEvent):  # response.output_text.delta
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ChatTokenLogprob]


class OutputTextDoneEvent(ResponseEvent):  # response.output_text.done
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ChatTokenLogprob]


class ArgumentsDeltaEvent(ResponseEvent):  # response.function_call_arguments.delta
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(ResponseEvent):  # response.function_call_arguments.done
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(ResponseEvent):  # error
    code: str | None = None
    message: str
    param: str | None = None
