"""The HTTP server: an OpenAI-compatible API over one engine, plus health, metrics and publishing.

    POST /v1/chat/completions, /v1/completions   (serving_chat.py, serving_completion.py)
    POST /v1/responses                            (serving_responses.py)
    POST /v1/cache/chunks                         publish a document to the shared namespace
    POST /tokenize, /detokenize                   vLLM's tokenizer endpoints
    GET  /v1/models, /v1/models/{id}, /health, /metrics

``create_app(config)`` loads the model when the app starts (lifespan) and stops the scheduler and
the store's background threads when it stops.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from irminsul.server.config import ServerConfig
from irminsul.server.metrics import LoopStalls
from irminsul.server.protocol import APIError, context_exceeded
from irminsul.server.serving_chat import OpenAIServingChat
from irminsul.server.serving_completion import OpenAIServingCompletion
from irminsul.server.serving_responses import OpenAIServingResponses

log = logging.getLogger("irminsul.server")


class ServerState:
    """The loaded model's tokenizer and chat renderer, the client of its engine, and the request-level policies."""

    def __init__(self, config: ServerConfig):
        from irminsul.bundled import bundled_model
        from irminsul.model.identity import checkpoint_id
        from irminsul.model.loader import load_model
        from irminsul.model.tokenizer import Tokenizer
        from irminsul.server.chat import ChatRenderer
        from irminsul.server.engine_client import EngineClient
        from irminsul.server.metrics import ServerMetrics
        from irminsul.server.workers import Workers

        self.config = config
        if config.threads is not None:
            import torch

            torch.set_num_threads(config.threads)
        path = Path(config.model) if config.model else bundled_model("mla")
        self.model_name = config.served_model_name or path.name
        model = load_model(path, dtype=config.dtype, device=config.device)
        if config.attention_backend != "torch":
            model.set_attention_backend(config.attention_backend)
        self.tokenizer = Tokenizer(path)
        self.renderer = ChatRenderer(self.tokenizer)
        # no token stands for more bytes than this, so a text of more than context x this many
        # characters cannot fit, and is refused before anyone tokenizes it
        self.max_token_bytes = max(1, max(len(self.tokenizer.token_bytes(t, False))
                                          for t in range(self.tokenizer.vocab_size)))
        if config.store.specs != ("memory",) and not config.store_secret:
            log.warning("the disk / Redis tiers have no --store-secret: whoever can write to them can "
                        "substitute cached rows undetected (see docs/serving.md, Security model)")
        self.metrics = ServerMetrics(self.model_name)
        self.client = EngineClient.create(model, self.tokenizer, checkpoint_id(path, config.dtype), config, self.metrics)
        self.context = self.client.context
        self.metrics.watch(self.client)
        self.stalls = LoopStalls()  # started with the app, on its event loop
        self.metrics.watch_loop(self.stalls)
        self.workers = Workers(config.prep_threads, config.prep_threads_per_tenant)
        self.started = time.time()

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def _bearer(self, request: Request) -> str:
        auth = request.headers.get("authorization", "")
        return auth[7:].strip() if auth[:7].lower() == "bearer " else ""

    def key_tenant(self, request: Request) -> str | None:
        """The API key's namespace ("key:<tenant>"), None when the server has no keys; a 401 when it
        has and the request brings none of them. Called before the body is read, so nobody without a
        key can make the server parse one."""
        tenants = self.config.tenants
        if not tenants:
            return None
        key = self._bearer(request)
        match = next((t for k, t in tenants.items() if hmac.compare_digest(k, key)), None)
        if match is None:
            raise APIError(401, "missing or unknown API key; send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        return f"key:{match}"

    def tenant_of(self, request: Request, cache_salt: str | None) -> str | None:
        """The request's cache namespace: the API key's tenant, subdivided by cache_salt.

        Names are prefixed ("key:", "salt:"), so no request can name another kind of namespace,
        and never the operator's shared one (reuse.SHARED).
        """
        tenant = self.key_tenant(request)
        if cache_salt is not None:
            tenant = f"{tenant or ''}|salt:{cache_salt}"
        return tenant

    def share_of(self, request: Request) -> str:
        """Whose share of the worker threads a request's preparation takes (workers.py): its API
        key's tenant (checked before: key_tenant), or without keys its client's address."""
        tenant = self.key_tenant(request)
        return tenant if tenant is not None else f"host:{request.client.host if request.client else ''}"

    def prepare(self, request: Request, fn, *args):
        """``fn(*args)`` on a worker thread, within the request's share of them (an awaitable)."""
        return self.workers.run(self.share_of(request), fn, *args)

    def check_text(self, chars: int, what: str, param: str) -> None:
        """Refuse a text that cannot fit in the context before it is tokenized (a body of megabytes
        tokenizes for seconds into millions of ids): no token is longer than max_token_bytes."""
        most = self.context * self.max_token_bytes
        if chars > most:
            raise context_exceeded(self.context, f"the {what} has {chars:,} characters, more than {self.context} "
                                                 f"tokens hold (no token is longer than {self.max_token_bytes} "
                                                 f"bytes)", param, what)

    def check_admin(self, request: Request) -> None:
        """Publishing fills the namespace every tenant reads: only the operator's key may do it."""
        admin, key = self.config.admin_key, self._bearer(request)
        if admin is None:
            raise APIError(403, "publishing is disabled: start the server with --admin-key to publish shared chunks")
        if not hmac.compare_digest(admin, key):
            raise APIError(403, "publishing shared chunks needs the admin key (--admin-key)")

    def close(self) -> None:
        """Stop the engine thread, the store's threads and the worker threads (idempotent: the app's
        shutdown and the CLI both call it)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.stalls.stop()
        self.client.stop()
        self.workers.close()


def create_app(config: ServerConfig, state: ServerState | None = None) -> FastAPI:
    """The app; it loads the model at startup unless a ready ``state`` is given (the CLI loads it
    first, so a bad checkpoint is reported as a one-line error, not an ASGI startup traceback)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal state
        if state is None:
            state = await asyncio.to_thread(ServerState, config)
        state.client.start()
        state.stalls.start()
        app.state.irminsul = state
        app.state.serving_chat = OpenAIServingChat(state)
        app.state.serving_completion = OpenAIServingCompletion(state)
        app.state.serving_responses = OpenAIServingResponses(state)
        log.info("serving %s (reuse=%s) on http://%s:%d", state.model_name, config.reuse, config.host, config.port)
        yield
        state.close()

    app = FastAPI(title="Irminsul", lifespan=lifespan)
    app.add_middleware(_OneFraming)

    def error(request: Request, e: APIError, headers=None) -> JSONResponse:
        """Every error answer: counted in irminsul_request_errors_total, OpenAI's body."""
        state = getattr(request.app.state, "irminsul", None)
        if state is not None:
            state.metrics.error(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=headers or e.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error(request, e)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error(request, APIError(500, f"internal error: {e}"))

    @app.exception_handler(ValueError)
    async def value_error(request: Request, e: ValueError):
        # Python refuses to read an integer literal of more digits than sys.get_int_max_str_digits()
        # (a guard against quadratic conversion): in a body, or in JSON sent inside one (guided_json)
        if "integer string conversion" in str(e):
            return error(request, APIError(400, f"the request holds an integer of more than "
                                                f"{sys.get_int_max_str_digits()} digits; no field takes one that long"))
        return await internal_error(request, e)

    @app.exception_handler(404)
    async def not_found(request: Request, e):
        return error(request, APIError(404, f"no route {request.method} {request.url.path}"))

    @app.exception_handler(405)
    async def bad_method(request: Request, e):
        allow = (getattr(e, "headers", None) or {}).get("Allow")
        return error(request, APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                       type="invalid_request_error"), headers={"Allow": allow} if allow else None)

    def state_of(request: Request) -> ServerState:
        return request.app.state.irminsul

    from irminsul.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard,
                                          ModelList, PublishRequest, ResponsesRequest, TokenizeRequest, body_schema,
                                          read_body)

    # NOTE: bodies are read and parsed by the handlers (size limit first, parsing off the event loop);
    # their models are declared here so /openapi.json describes them.
    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await request.app.state.serving_chat.create(request)

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request):
        return await request.app.state.serving_completion.create(request)

    @app.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
    async def responses(request: Request):
        return await request.app.state.serving_responses.create(request)

    @app.post("/v1/cache/chunks", openapi_extra=body_schema(PublishRequest))
    async def publish(request: Request):
        return await _publish(state_of(request), request)

    def model_card(s: ServerState) -> ModelCard:
        return ModelCard(id=s.model_name, created=int(s.started), max_model_len=s.context,
                         irminsul={"reuse": s.client.reuse, "store": list(s.config.store.specs)})

    @app.get("/v1/models")
    async def models(request: Request):
        return ModelList(data=[model_card(state_of(request))]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        s = state_of(request)
        s.check_model(model_id)
        return model_card(s).model_dump()

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
    async def tokenize(request: Request):
        """vLLM's: {"prompt": str} or {"messages": [...]} (rendered with the chat template) -> token ids."""
        s = state_of(request)
        s.key_tenant(request)  # (a 401 before the body is read)
        raw = await read_body(request, s.config.max_request_bytes)
        return await s.prepare(request, _tokenize, s, raw)

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest))
    async def detokenize(request: Request):
        s = state_of(request)
        s.key_tenant(request)  # (a 401 before the body is read)
        raw = await read_body(request, s.config.max_request_bytes)
        return await s.prepare(request, _detokenize, s, raw)

    @app.get("/health")
    async def health(request: Request):
        if not state_of(request).client.alive:
            return JSONResponse({"status": "engine thread stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        s = state_of(request)
        await s.client.refresh_stats()
        return Response(s.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


class _OneFraming:
    """Refuse a request that says how long its body is twice, with Content-Length and
    Transfer-Encoding both (RFC 9112 section 6.1): h11 reads it by Transfer-Encoding, and a proxy in
    front that reads it by Content-Length would take the rest for another request (smuggling).
    The answer closes the connection, so nothing left of the body is read as a request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            names = {name.lower() for name, _ in scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                state = getattr(scope["app"].state, "irminsul", None) if "app" in scope else None
                if state is not None:
                    state.metrics.error(400)
                e = APIError(400, "the request has both Content-Length and Transfer-Encoding; send only one")
                await JSONResponse(e.body(), status_code=400, headers={"Connection": "close"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _tokenize(state: ServerState, raw: bytes) -> dict:
    from irminsul.server.protocol import TokenizeRequest, TokenizeResponse, parse_body
    from irminsul.server.serving_base import text_chars

    req = parse_body(raw, TokenizeRequest, state.context)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send exactly one of 'prompt' (a string) or 'messages' (a chat)")
    if req.prompt is not None:
        state.check_text(len(req.prompt), "prompt", "prompt")
        ids = state.tokenizer.encode(req.prompt, None if req.add_special_tokens else False)
    else:
        state.check_text(text_chars(req.messages) + text_chars(req.tools), "messages", "messages")
        try:
            ids = state.renderer.render(req.messages, req.tools, req.add_generation_prompt,
                                        req.continue_final_message, req.chat_template_kwargs).token_ids
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
    return TokenizeResponse(count=len(ids), max_model_len=state.context, tokens=ids).model_dump()


def _detokenize(state: ServerState, raw: bytes) -> dict:
    from irminsul.server.protocol import DetokenizeRequest, DetokenizeResponse, parse_body

    req = parse_body(raw, DetokenizeRequest, state.context)
    state.check_model(req.model)
    vocab = state.client.vocab_size
    if bad := [t for t in req.tokens if not 0 <= t < vocab]:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens, False)).model_dump()


async def _publish(state: ServerState, request: Request) -> dict:
    """{"text": str} or {"token_ids": [int]}: precompute in a trusted context and share with all tenants."""
    from irminsul.errors import RequestError
    from irminsul.server.engine_client import Busy
    from irminsul.server.protocol import PublishResponse, read_body

    state.check_admin(request)
    raw = await read_body(request, state.config.max_request_bytes)
    tokens, param = await state.workers.run("admin", _publish_tokens, state, raw)  # (the operator's own share)
    try:
        done = await state.client.publish(tokens)
    except Busy as e:
        raise APIError(503, str(e), retry_after=1) from None
    except RequestError as e:
        raise APIError(400, str(e), param=param) from None
    return PublishResponse(tokens=len(tokens), entries=done.entries, stored_tokens=done.tokens, skipped=done.skipped,
                           rejected=done.rejected).model_dump()


def _publish_tokens(state: ServerState, raw: bytes) -> tuple[list[int], str]:
    """A publish body's document as token ids, and the field it came in (on a worker thread)."""
    from irminsul.server.protocol import PublishRequest, parse_body

    req = parse_body(raw, PublishRequest, state.context)
    state.check_model(req.model)
    if state.client.reuse not in ("pic", "naive"):
        raise APIError(400, f"publishing needs content reuse (--reuse pic or naive); this server runs "
                            f"--reuse {state.client.reuse}")
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
