"""The HTTP server: an OpenAI-compatible API over one engine, plus health, metrics and publishing.

    POST /v1/chat/completions, /v1/completions   (completions.py)
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
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from irminsul.server.config import ServerConfig
from irminsul.server.protocol import APIError

log = logging.getLogger("irminsul.server")


class ServerState:
    """The loaded model, its engine and scheduler, and the request-level policies."""

    def __init__(self, config: ServerConfig):
        from irminsul.bundled import bundled_model
        from irminsul.cache.store import RowLayout, open_registry
        from irminsul.engine.engine import Engine, default_kv_cache_gib
        from irminsul.model.identity import checkpoint_id
        from irminsul.model.loader import load_model
        from irminsul.model.tokenizer import Tokenizer
        from irminsul.server.chat import ChatRenderer
        from irminsul.server.metrics import ServerMetrics
        from irminsul.server.runner import EngineRunner

        self.config = config
        path = Path(config.model) if config.model else bundled_model("mla")
        self.model_name = config.served_model_name or path.name
        model = load_model(path, dtype=config.dtype, device=config.device)
        if config.attention_backend != "torch":
            model.set_attention_backend(config.attention_backend)
        self.tokenizer = Tokenizer(path)
        self.renderer = ChatRenderer(self.tokenizer)
        self.context = model.config.max_position_embeddings
        model_id = checkpoint_id(path, config.dtype)
        layout = RowLayout.of(model, model_id, secret=(config.store_secret or "").encode())
        if config.store.specs != ("memory",) and not config.store_secret:
            log.warning("the disk / Redis tiers have no --store-secret: whoever can write to them can "
                        "substitute cached rows undetected (see docs/serving.md, Security model)")
        pool_gib = config.kv_cache_gib if config.kv_cache_gib is not None else default_kv_cache_gib(model.device)
        self.registry = (open_registry(config.store, layout, memory_bytes=int(pool_gib * 2**30))
                         if config.reuse != "off" else None)
        self.engine = Engine(model, self.tokenizer, reuse=config.reuse, max_prefill_tokens=config.max_prefill_tokens,
                             kv_cache_gib=pool_gib, compile_decode=config.compile_decode, model_id=model_id,
                             registry=self.registry)
        self.metrics = ServerMetrics(self.model_name)
        self.runner = EngineRunner(self.engine, config.max_running_requests, config.max_queued_requests, self.metrics)
        self.metrics.watch(self.runner, self.engine.cache)
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

    def check_admin(self, request: Request) -> None:
        """Publishing fills the namespace every tenant reads: only the operator's key may do it."""
        admin, key = self.config.admin_key, self._bearer(request)
        if admin is None:
            raise APIError(403, "publishing is disabled: start the server with --admin-key to publish shared chunks")
        if not hmac.compare_digest(admin, key):
            raise APIError(403, "publishing shared chunks needs the admin key (--admin-key)")

    def close(self) -> None:
        """Stop the engine thread and the store's threads (idempotent: the app's shutdown and the CLI
        both call it)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.runner.stop()
        if hasattr(self.registry, "close"):
            self.registry.close()


def create_app(config: ServerConfig, state: ServerState | None = None) -> FastAPI:
    """The app; it loads the model at startup unless a ready ``state`` is given (the CLI loads it
    first, so a bad checkpoint is reported as a one-line error, not an ASGI startup traceback)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal state
        if state is None:
            state = await asyncio.to_thread(ServerState, config)
        state.runner.start()
        app.state.irminsul = state
        log.info("serving %s (reuse=%s) on http://%s:%d", state.model_name, config.reuse, config.host, config.port)
        yield
        state.close()

    app = FastAPI(title="Irminsul", lifespan=lifespan)

    def error(request: Request, e: APIError, headers=None) -> JSONResponse:
        """Every error answer: counted in irminsul_request_errors_total, OpenAI's body."""
        state = getattr(request.app.state, "irminsul", None)
        if state is not None:
            state.metrics.error(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error(request, e)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error(request, APIError(500, f"internal error: {e}"))

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

    from irminsul.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, PublishRequest,
                                          TokenizeRequest, body_schema, parse_body, read_body)
    from irminsul.server.responses import ResponsesRequest

    # NOTE: bodies are read and parsed by the handlers (size limit first, parsing off the event loop);
    # their models are declared here so /openapi.json describes them.
    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        from irminsul.server.completions import handle

        return await handle(state_of(request), request, chat=True)

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request):
        from irminsul.server.completions import handle

        return await handle(state_of(request), request, chat=False)

    @app.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
    async def responses(request: Request):
        from irminsul.server.responses import handle

        return await handle(state_of(request), request)

    @app.post("/v1/cache/chunks", openapi_extra=body_schema(PublishRequest))
    async def publish(request: Request):
        return await _publish(state_of(request), request)

    def model_card(s: ServerState) -> dict:
        return {"id": s.model_name, "object": "model", "created": int(s.started), "owned_by": "irminsul",
                "max_model_len": s.context, "irminsul": {"reuse": s.engine.reuse, "store": list(s.config.store.specs)}}

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [model_card(state_of(request))]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        s = state_of(request)
        s.check_model(model_id)
        return model_card(s)

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
    async def tokenize(request: Request):
        """vLLM's: {"prompt": str} or {"messages": [...]} (rendered with the chat template) -> token ids."""
        s = state_of(request)
        req = await asyncio.to_thread(parse_body, await read_body(request, s.config.max_request_bytes), TokenizeRequest)
        s.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of 'prompt' (a string) or 'messages' (a chat)")
        if req.prompt is not None:
            ids = await asyncio.to_thread(s.tokenizer.encode, req.prompt, None if req.add_special_tokens else False)
        else:
            try:
                ids = (await asyncio.to_thread(s.renderer.render, req.messages, req.tools, req.add_generation_prompt,
                                               req.continue_final_message, req.chat_template_kwargs)).token_ids
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
        return {"count": len(ids), "max_model_len": s.context, "tokens": ids}

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest))
    async def detokenize(request: Request):
        s = state_of(request)
        req = await asyncio.to_thread(parse_body, await read_body(request, s.config.max_request_bytes),
                                      DetokenizeRequest)
        s.check_model(req.model)
        vocab = s.engine.config.vocab_size
        if bad := [t for t in req.tokens if not 0 <= t < vocab]:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(s.tokenizer.decode, req.tokens, False)}

    @app.get("/health")
    async def health(request: Request):
        if not state_of(request).runner.alive:
            return JSONResponse({"status": "engine thread stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        s = state_of(request)
        await s.runner.refresh_stats()
        return Response(s.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


async def _publish(state: ServerState, request: Request) -> dict:
    """{"text": str} or {"token_ids": [int]}: precompute in a trusted context and share with all tenants."""
    import json

    from irminsul.engine.engine import PoolBusy
    from irminsul.errors import RequestError
    from irminsul.server.protocol import check_values, read_body

    state.check_admin(request)
    try:
        body = json.loads(await read_body(request, state.config.max_request_bytes))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict) or ("text" in body) == ("token_ids" in body):
        raise APIError(400, "send exactly one of 'text' (a string) or 'token_ids' (a list of ints)")
    check_values(body)  # lone surrogates, deep nesting: as every other endpoint
    state.check_model(body.get("model"))
    if state.engine.reuse not in ("pic", "naive"):
        raise APIError(400, f"publishing needs content reuse (--reuse pic or naive); this server runs "
                            f"--reuse {state.engine.reuse}")
    if "text" in body:
        if not isinstance(body["text"], str) or not body["text"]:
            raise APIError(400, "'text' must be a non-empty string", param="text")
        tokens = state.tokenizer.encode(body["text"], add_bos=False)
    else:
        tokens = body["token_ids"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise APIError(400, "'token_ids' must be a list of integers", param="token_ids")
    try:
        state.engine.validate_prompt(tokens, room=0)
    except ValueError as e:
        raise APIError(400, str(e), param="text" if "text" in body else "token_ids") from None
    try:
        done = await asyncio.wrap_future(state.runner.call(state.engine.publish, tokens))
    except PoolBusy as e:
        raise APIError(503, str(e)) from None
    except RequestError as e:
        raise APIError(400, str(e), param="text" if "text" in body else "token_ids") from None
    return {"object": "cache.chunks", "tokens": len(tokens), "entries": done.entries,
            "stored_tokens": done.tokens, "skipped": done.skipped, "rejected": done.rejected}
