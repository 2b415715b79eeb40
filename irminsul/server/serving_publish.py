"""POST /v1/cache/chunks: the operator publishes a document, precomputed in a trusted context, to the
namespace every tenant reads (only with --admin-key, and content reuse on)."""

from __future__ import annotations

from fastapi import Request

from irminsul.errors import RequestError
from irminsul.server.body import decode_body, read_body, validated
from irminsul.server.engine_client import Busy
from irminsul.server.errors import APIError
from irminsul.server.protocol import PublishRequest, PublishResponse


def parse_publish(raw: bytes, context: int | None = None) -> PublishRequest:
    """A publish body: exactly one of a non-empty text or a list of token ids (a 400 otherwise)."""
    data = decode_body(raw, context)
    if ("text" in data) == ("token_ids" in data):
        raise APIError(400, "send exactly one of 'text' (a string) or 'token_ids' (a list of ints)")
    if "text" in data and (not isinstance(data["text"], str) or not data["text"]):
        raise APIError(400, "'text' must be a non-empty string", param="text")
    ids = data.get("token_ids")
    if "token_ids" in data and not (
        isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise APIError(400, "'token_ids' must be a list of integers", param="token_ids")
    return validated(PublishRequest, data)


class ServingPublish:
    def __init__(self, state):
        self.state = state

    async def create(self, request: Request) -> dict:
        """{"text": str} or {"token_ids": [int]}: precompute in a trusted context and share with all tenants."""
        state = self.state
        state.tenancy.check_admin(request)
        raw = await read_body(request, state.config.max_request_bytes)
        tokens, param = await state.workers.run("admin", self._tokens, raw)  # (the operator's own share)
        try:
            done = await state.client.publish(tokens)
        except Busy as e:
            raise APIError(503, str(e), retry_after=1) from None
        except RequestError as e:
            raise APIError(400, str(e), param=param) from None
        return PublishResponse(
            tokens=len(tokens),
            entries=done.entries,
            stored_tokens=done.tokens,
            skipped=done.skipped,
            rejected=done.rejected,
        ).model_dump()

    def _tokens(self, raw: bytes) -> tuple[list[int], str]:
        """A publish body's document as token ids, and the field it came in (on a worker thread)."""
        state = self.state
        req = parse_publish(raw, state.context)
        state.check_model(req.model)
        if state.client.reuse not in ("pic", "naive"):
            raise APIError(
                400,
                f"publishing needs content reuse (--reuse pic or naive); this server runs --reuse {state.client.reuse}",
            )
        if req.text is not None:
            param = "text"
            state.check_text(len(req.text), "text", "text")
            tokens = state.tokenizer.encode(req.text, add_bos=False)
        else:
            param, tokens = "token_ids", req.token_ids
        try:
            state.client.validate(tokens, room=0)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        return tokens, param
