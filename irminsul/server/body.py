"""A request's body: read within --max-request-bytes, decoded, bounded, and validated into its model.

Every failure is a 400 (a 413 for size) that says what was wrong. Nothing walks a body before its
lists are counted against their bounds (limits.py): the count is O(its fields), a walk O(its size).
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from irminsul.server.errors import APIError, context_exceeded
from irminsul.server.limits import ID_FIELDS, MAX_CHOICES, MAX_DEPTH, SIZE_BOUNDS


async def read_body(request, limit: int) -> bytes:
    """The request body, refused with a 413 as soon as it is larger than `limit` bytes: by its
    Content-Length before anything is read, else as it streams in."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(
            413, f"the request body is {int(declared)} bytes; this server takes at most {limit} (--max-request-bytes)"
        )
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
            raise APIError(
                400, f"{path or 'a string'} holds an unpaired UTF-16 surrogate; send valid Unicode", param=path or None
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_values(k, path, depth + 1)
            check_values(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_values(v, f"{path}[{i}]", depth + 1)


def parse_body(raw: bytes, model: type[BaseModel], context: int | None = None):
    """Raw body -> request model; every failure is a 400 that says what was wrong. `context`: the
    model's, which bounds lists of token ids (None: left to the checks after parsing)."""
    return validated(model, decode_body(raw, context))


def decode_body(raw: bytes, context: int | None = None) -> dict:
    """Raw body -> its JSON object, within the bounds on its lists and free of what no engine takes."""
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
    return data


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
            raise APIError(
                400, f"prompt holds {len(prompt):,} prompts; at most {MAX_CHOICES} per request", param="prompt"
            )
        prompt = max((p for p in prompt if isinstance(p, list)), key=len, default=None)
    if context is None:
        return
    for field in ID_FIELDS:
        value = data.get(field)
        if isinstance(value, list) and len(value) > context:
            raise APIError(
                400,
                f"{field} holds {len(value):,} ids; at most {context} (the model's context) per request",
                param=field,
            )
    if isinstance(prompt, list) and len(prompt) >= context:  # (token ids: one position is left to answer)
        raise context_exceeded(
            context,
            f"your prompt has {len(prompt):,} tokens (at most {context - 1} leave room for an answer)",
            "prompt",
            "prompt",
        )


def validated(model: type[BaseModel], data: dict):
    """A request model from its fields; a failure is a 400 naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or None
        more = f" (and {len(e.errors()) - 1} more problems)" if len(e.errors()) > 1 else ""
        raise APIError(400, f"{loc}: {err['msg']}{more}", param=loc) from None
