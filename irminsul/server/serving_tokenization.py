"""POST /tokenize and /detokenize, vLLM's tokenizer endpoints: a prompt or a chat -> token ids, and back."""

from __future__ import annotations

from fastapi import Request

from irminsul.server.body import parse_body, read_body
from irminsul.server.errors import APIError
from irminsul.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from irminsul.server.serving_base import text_chars
from irminsul.server.serving_chat import render_prompt


class OpenAIServingTokenization:
    def __init__(self, state):
        self.state = state

    async def tokenize(self, request: Request) -> dict:
        """{"prompt": str} or {"messages": [...]} (rendered with the chat template) -> token ids."""
        return await self._run(request, self._tokenize)

    async def detokenize(self, request: Request) -> dict:
        return await self._run(request, self._detokenize)

    async def _run(self, request: Request, fn) -> dict:
        s = self.state
        s.tenancy.key_tenant(request)  # (a 401 before the body is read)
        raw = await read_body(request, s.config.max_request_bytes)
        return await s.prepare(request, fn, raw)

    def _tokenize(self, raw: bytes) -> dict:
        state = self.state
        req = parse_body(raw, TokenizeRequest, state.context)
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of 'prompt' (a string) or 'messages' (a chat)")
        if req.prompt is not None:
            state.check_text(len(req.prompt), "prompt", "prompt")
            ids = state.tokenizer.encode(req.prompt, None if req.add_special_tokens else False)
        else:
            state.check_text(text_chars(req.messages) + text_chars(req.tools), "messages", "messages")
            ids = render_prompt(state.renderer, req).token_ids
        return TokenizeResponse(count=len(ids), max_model_len=state.context, tokens=ids).model_dump()

    def _detokenize(self, raw: bytes) -> dict:
        state = self.state
        req = parse_body(raw, DetokenizeRequest, state.context)
        state.check_model(req.model)
        vocab = state.client.vocab_size
        if bad := [t for t in req.tokens if not 0 <= t < vocab]:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens, False)).model_dump()
