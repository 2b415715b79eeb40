"""A request's prompt as a replica will see it, for the router: its token ids, segment starts and tenant.

The fleet's ingress reads each body once, on a worker thread, and hands the router a `RouteKey`. It
reads with the server's own functions: bodies parsed by `body.parse_body` (a document to publish
by `serving_publish.parse_publish`, as the shared namespace's), chats rendered by
`serving_chat.render_prompt` (the Responses API through `to_chat`, as the replica converts it),
completion prompts split and encoded by `serving_completion`'s `prompt_batch` and
`batch_token_ids`. The tenant is decided by the server's own policy (`irminsul.server.tenancy`: the
API key's tenant, subdivided by `cache_salt`), so a chunk is fingerprinted in the namespace the
replica will store it in.

Whatever the router cannot read (a body the replica will refuse) routes without a key, by load: the
replica answers the error, as a single server would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from irminsul.server.body import parse_body
from irminsul.server.config import ServerConfig
from irminsul.server.errors import APIError
from irminsul.server.protocol import ChatCompletionRequest, CompletionRequest
from irminsul.server.protocol_responses import ResponsesRequest
from irminsul.server.serving_base import text_chars
from irminsul.server.serving_chat import render_prompt
from irminsul.server.serving_completion import batch_token_ids, prompt_batch
from irminsul.server.serving_publish import parse_publish
from irminsul.server.serving_responses import to_chat
from irminsul.server.tenancy import Tenancy


@dataclass(frozen=True)
class RouteKey:
    """What the content router chooses by; it travels to the replica beside the request."""

    token_ids: np.ndarray = field(repr=False)  # [n] int32 (4 bytes a token on the wire)
    segment_starts: tuple[int, ...] | None
    tenant: str | None  # the replica's namespace name; None: its default
    stored: frozenset[int] = frozenset()  # the prompt's chunk fingerprints the shared store holds
    explanation: str = ""  # the router's choice, set when it routes (the x-irminsul-route header)


class PromptReader:
    def __init__(self, config: ServerConfig, tokenizer, renderer):
        """`renderer`: None, chats and responses have no key (a vLLM fleet: vLLM renders them itself)."""
        self.tenancy = Tenancy(config)
        self.tokenizer, self.renderer = tokenizer, renderer
        # texts longer than this are left unread: the replica refuses them before it tokenizes them
        # (the context times the most bytes one token stands for); the replicas' metadata says it
        self.max_chars = config.max_request_bytes

    def key_tenant(self, request) -> str | None:
        """A 401 (APIError) when the fleet has keys and the request brings none of them."""
        return self.tenancy.key_tenant(request)

    def route_key(self, path: str, request, body: bytes) -> RouteKey | None:
        """The prompt of a body sent to `path` (None when it has none, or the replica will refuse it)."""
        try:
            return self._read(path, request, body)
        except (APIError, ValueError, TypeError, KeyError, json.JSONDecodeError):
            return None

    def _read(self, path: str, request, body: bytes) -> RouteKey | None:
        if path in ("/v1/chat/completions", "/v1/responses") and self.renderer is None:
            return None
        if path == "/v1/chat/completions":
            req = parse_body(body, ChatCompletionRequest)
        elif path == "/v1/responses":
            req = to_chat(parse_body(body, ResponsesRequest))
        elif path == "/v1/completions":
            req = parse_body(body, CompletionRequest)
            batch = prompt_batch(req.prompt)
            if sum(len(p) for p in batch if isinstance(p, str)) > self.max_chars:
                return None
            ids = batch_token_ids(self.tokenizer, batch)
            # a batch routes as one prompt: chunking restarts at each prompt's start, so its chunks
            # are each prompt's own
            starts = tuple(int(s) for s in np.cumsum([0] + [len(p) for p in ids[:-1]])) if len(ids) > 1 else None
            return self._key(sum(ids, []), starts, self.tenancy.tenant_of(request, req.cache_salt))
        elif path == "/v1/cache/chunks":
            from irminsul.kvcache.namespaces import SHARED

            req = parse_publish(body)
            if req.text is not None and len(req.text) > self.max_chars:
                return None
            tokens = self.tokenizer.encode(req.text, add_bos=False) if req.text is not None else req.token_ids
            return self._key(tokens, None, SHARED)
        else:
            return None
        if text_chars(req.messages) > self.max_chars:
            return None
        rendered = render_prompt(self.renderer, req)
        return self._key(
            rendered.token_ids, tuple(rendered.segment_starts), self.tenancy.tenant_of(request, req.cache_salt)
        )

    @staticmethod
    def _key(tokens, starts, tenant) -> RouteKey | None:
        return RouteKey(np.asarray(tokens, np.int32), starts, tenant) if len(tokens) else None
