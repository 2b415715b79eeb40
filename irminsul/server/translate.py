"""A parsed request -> what the engine takes: checks against what it can honour, sampling parameters,
structured-output constraints, tool functions, the output budget; its results -> usage.

Behaviour follows OpenAI's API and vLLM's server where they agree: a field we know and cannot
honour (``best_of``, ``suffix``, an image part ...) is a 400 that names it, never ignored.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from irminsul.engine.grammar import Constraint
from irminsul.engine.grammar_limits import parse_json
from irminsul.engine.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from irminsul.engine.sequence import RequestStats
from irminsul.errors import RequestError
from irminsul.server.errors import APIError, context_exceeded
from irminsul.server.limits import MAX_CHOICES, MAX_MESSAGES, MAX_PARTS, MAX_STOP, MAX_STOP_CHARS
from irminsul.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    IrminsulUsage,
    PromptTokensDetails,
    UsageInfo,
)


def check_supported(req: GenerationRequest, messages: str = "messages") -> None:
    """Refuse parameters we know and cannot honour (`messages`: what the request calls a chat's messages)."""
    refuse = [
        ("n", not 1 <= req.n <= MAX_CHOICES, f"n={req.n} must be in [1, {MAX_CHOICES}]"),
        ("best_of", req.best_of not in (None, 1), "best_of is not supported"),
        ("echo", getattr(req, "echo", False) and req.stream, "echo is not supported with stream=true yet"),
        (
            "stream_options",
            req.stream_options is not None and not req.stream,
            "stream_options can only be set when stream=true",
        ),
    ]
    if isinstance(req, ChatCompletionRequest):
        top = req.top_logprobs
        refuse += [
            ("top_logprobs", top is not None and not req.logprobs, "top_logprobs needs logprobs=true"),
            (
                "top_logprobs",
                top is not None and not (isinstance(top, int) and 0 <= top <= MAX_TOP_LOGPROBS),
                f"top_logprobs={top!r} must be an integer in [0, {MAX_TOP_LOGPROBS}]",
            ),
        ]
    elif isinstance(req, CompletionRequest):
        refuse += [
            ("suffix", bool(req.suffix), "suffix is not supported"),
            ("top_logprobs", req.top_logprobs is not None, "top_logprobs is a chat field; completions take logprobs=N"),
        ]
    for param, bad, message in refuse:
        if bad:
            raise APIError(400, message, param=param, code="unsupported_parameter")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])  # (their number: check_sizes)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(
            400, f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each", param="stop"
        )
    if isinstance(req, ChatCompletionRequest):
        if len(req.messages) > MAX_MESSAGES:  # (a Responses request's input, converted)
            raise APIError(400, f"at most {MAX_MESSAGES} messages per request", param=messages)
        if (
            sum(len(m["content"]) for m in req.messages if isinstance(m, dict) and isinstance(m.get("content"), list))
            > MAX_PARTS
        ):
            raise APIError(400, f"at most {MAX_PARTS} content parts per request (in all its messages)", param=messages)
    if req.cache_salt is not None and not (0 < len(req.cache_salt) <= 256):
        raise APIError(400, "cache_salt must be a non-empty string of at most 256 characters", param="cache_salt")


NON_TEXT_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file", "input_file", "video_url")


def check_text_only(req: ChatCompletionRequest, messages: str = "messages") -> None:
    """The served model reads and writes text only: image, audio and file parts, an audio output
    and non-text modalities are refused with the field named, never ignored."""
    extra = req.model_extra or {}
    modalities = extra.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise APIError(
            400,
            f"modalities={modalities!r}: this model produces text only; send ['text'] or leave it out",
            param="modalities",
            code="unsupported_parameter",
        )
    if extra.get("audio") is not None:
        raise APIError(
            400,
            "audio output is not supported: this model produces text only",
            param="audio",
            code="unsupported_parameter",
        )
    for i, m in enumerate(req.messages):
        if not isinstance(m, dict):
            continue
        if m.get("audio") is not None:
            raise APIError(
                400,
                f"{messages}[{i}].audio: this model takes text only",
                param=f"{messages}[{i}].audio",
                code="unsupported_content",
            )
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in NON_TEXT_PARTS:
                where = f"{messages}[{i}].content[{j}]"
                raise APIError(
                    400,
                    f"{where} is an {kind!r} part: this model takes text only (parts of type 'text')",
                    param=f"{where}.type",
                    code="unsupported_content",
                )


def requested_logprobs(req: GenerationRequest) -> int | None:
    """None (off) or how many alternatives per token: chat says logprobs=true + top_logprobs=N,
    completions logprobs=N."""
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs is not None and not isinstance(req.logprobs, bool):
            raise APIError(400, "logprobs must be true or false for chat completions", param="logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    if req.logprobs is None or req.logprobs is False:
        return None
    if isinstance(req.logprobs, bool) or not isinstance(req.logprobs, int):
        raise APIError(
            400, "logprobs must be an integer (the number of alternatives) for completions", param="logprobs"
        )
    return req.logprobs


def _logit_bias(bias: dict | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id as a string": bias} -> ((id, bias), ...); at most MAX_LOGIT_BIAS entries,
    counted before any is read."""
    bias = bias or {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(
            400, f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed", param="logit_bias"
        )
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise APIError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise APIError(400, f"logit_bias[{key!r}] must be a number", param="logit_bias")
        out.append((token, float(value)))
    return tuple(out)


def constraint_of(
    req: GenerationRequest, response_format: str = "response_format"
) -> tuple[Constraint | None, str | None]:
    """The structured-output constraint a request asks for, and the field that asked (for errors;
    `response_format`: what the request calls that field)."""
    asked: list[tuple[str, Callable[[], Constraint]]] = []  # (the field, its constraint's maker)
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            asked.append((response_format, lambda: Constraint.json_schema(None)))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise APIError(
                    400,
                    f"{response_format} type 'json_schema' needs json_schema.schema, a JSON schema object",
                    param=response_format,
                )
            asked.append((response_format, lambda: Constraint.json_schema(schema)))
        elif kind != "text":
            raise APIError(
                400,
                f"{response_format} type {kind!r} must be one of 'text', 'json_object', 'json_schema'",
                param=response_format,
            )
    so = req.structured_outputs or {}
    if not isinstance(so, dict):
        raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
    makers: list[tuple[str, Any, Callable[[Any], Constraint]]] = [
        ("guided_json", req.guided_json, _json_constraint),
        ("guided_regex", req.guided_regex, Constraint.regex),
        ("guided_choice", req.guided_choice, Constraint.choice),
        ("guided_grammar", req.guided_grammar, Constraint.lark),
        ("structured_outputs.json", so.get("json"), _json_constraint),
        ("structured_outputs.regex", so.get("regex"), Constraint.regex),
        ("structured_outputs.choice", so.get("choice"), Constraint.choice),
        ("structured_outputs.grammar", so.get("grammar"), Constraint.lark),
    ]
    for name, value, make in makers:
        if value is not None:
            asked.append((name, functools.partial(make, value)))
    if not asked:
        return None, None
    if len(asked) > 1:
        raise APIError(
            400, f"{' and '.join(n for n, _ in asked)} each constrain the output; set only one", param=asked[1][0]
        )
    name, build = asked[0]
    try:
        return build(), name
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
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        named = choice["function"]["name"]
    else:
        raise APIError(
            400,
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if not functions:
        raise APIError(400, f"tool_choice={choice!r} needs tools", param="tool_choice")
    if named is not None and named not in [f.get("name") for f in functions]:
        raise APIError(
            400, f"tool_choice names the function {named!r}, which is not among the tools", param="tool_choice"
        )
    return functions


def _function(i: int, tool) -> dict:
    """tools[i]'s function: {"type": "function", "function": {"name": ..., "parameters": {...}}}
    (or the function object itself, as some clients send it)."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise APIError(
            400, f"{where} must be an object {{'type': 'function', 'function': {{'name': ...}}}}", param=where
        )
    if tool.get("type", "function") != "function":
        raise APIError(400, f"{where}.type is {tool['type']!r}; only 'function' tools are supported", param=where)
    fn = tool.get("function", tool)
    if "function" in tool:
        where += ".function"
    if not isinstance(fn, dict):
        raise APIError(
            400,
            f"{where} must be an object with a name (and parameters, a JSON schema), not {type(fn).__name__}",
            param=where,
        )
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise APIError(400, f"{where}.name must be a non-empty string", param=where)
    if not isinstance(fn.get("parameters", {}) or {}, dict):
        raise APIError(
            400, f"{where}.parameters must be a JSON schema object, not {type(fn['parameters']).__name__}", param=where
        )
    return fn


def sampling_params(req: GenerationRequest, max_tokens: int, constraint: Constraint | None = None) -> SamplingParams:
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


def resolve_max_tokens(
    requested: int | None, prompt_tokens: int, context: int, default: int, name: str = "max_tokens"
) -> int:
    """vLLM's rule: an explicit max_tokens (the request's field `name`) must fit the context; a
    missing one is capped by it."""
    room = context - prompt_tokens
    if requested is None:
        return max(1, min(default, room))
    if requested < 1:
        raise APIError(400, f"{name}={requested} must be at least 1", param=name)
    if requested > room:
        raise context_exceeded(
            context,
            f"you requested {prompt_tokens + requested} tokens ({prompt_tokens} in the "
            f"prompt, {requested} in the completion: {name}={requested}, at most "
            f"{room} fit)",
            name,
            "prompt or completion",
        )
    return requested


def usage(stats: RequestStats, completion_tokens: int) -> UsageInfo:
    """OpenAI usage; cached_tokens = prefix + reused, split in the ``irminsul`` block."""
    return UsageInfo(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=stats.prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.prefix_tokens + stats.reused_tokens),
        irminsul=IrminsulUsage(
            prefix_tokens=stats.prefix_tokens,
            reused_tokens=stats.reused_tokens,
            carve_out_tokens=stats.carve_out_tokens,
            computed_tokens=stats.computed_tokens,
            s1_tokens=stats.s1_tokens,
        ),
    )


def summed_usage(parts: list[UsageInfo]) -> UsageInfo:
    """Field by field sum of usage objects (nested blocks too)."""

    def add(values: list[dict]) -> dict:
        return {
            k: add([v[k] for v in values]) if isinstance(x, dict) else sum(v[k] for v in values)
            for k, x in values[0].items()
        }

    return UsageInfo.model_validate(add([p.model_dump() for p in parts]))
