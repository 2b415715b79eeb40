"""The HTTP server: an OpenAI-compatible API over one engine, plus health, metrics and publishing.

    POST /v1/chat/completions, /v1/completions   (serving_chat.py, serving_completion.py)
    POST /v1/responses                            (serving_responses.py)
    POST /v1/cache/chunks                         publish a document to the shared namespace (serving_publish.py)
    POST /tokenize, /detokenize                   vLLM's tokenizer endpoints (serving_tokenization.py)
    GET  /v1/models, /v1/models/{id}, /health, /metrics

The routes are routes.py's; ``create_app(config)`` adds the error answers and loads the model when
the app starts (lifespan: state.py's ServerState), and stops the scheduler and the store's
background threads when it stops.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from irminsul.server.config import ServerConfig
from irminsul.server.errors import APIError
from irminsul.server.routes import router
from irminsul.server.serving_chat import OpenAIServingChat
from irminsul.server.serving_completion import OpenAIServingCompletion
from irminsul.server.serving_publish import ServingPublish
from irminsul.server.serving_responses import OpenAIServingResponses
from irminsul.server.serving_tokenization import OpenAIServingTokenization
from irminsul.server.state import ServerState

log = logging.getLogger("irminsul.server")


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
        app.state.serving_tokenization = OpenAIServingTokenization(state)
        app.state.serving_publish = ServingPublish(state)
        log.info("serving %s (reuse=%s) on http://%s:%d", state.model_name, config.reuse, config.host, config.port)
        yield
        state.close()

    app = FastAPI(title="Irminsul", lifespan=lifespan)
    app.add_middleware(_OneFraming)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_exception_handler(ValueError, _value_error)
    app.add_exception_handler(404, _not_found)
    app.add_exception_handler(405, _bad_method)
    app.include_router(router)
    return app


def _error(request: Request, e: APIError, headers=None) -> JSONResponse:
    """Every error answer: counted in irminsul_request_errors_total, OpenAI's body."""
    state = getattr(request.app.state, "irminsul", None)
    if state is not None:
        state.metrics.error(e.status)
    return JSONResponse(e.body(), status_code=e.status, headers=headers or e.headers)


# (the handlers take any Exception, as Starlette's signature has them; each gets the class it is registered for)
async def _api_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, APIError)  # registered for APIError
    return _error(request, e)


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return _error(request, APIError(500, f"internal error: {e}"))


async def _value_error(request: Request, e: Exception) -> JSONResponse:  # (a ValueError)
    # Python refuses to read an integer literal of more digits than sys.get_int_max_str_digits()
    # (a guard against quadratic conversion): in a body, or in JSON sent inside one (guided_json)
    if "integer string conversion" in str(e):
        return _error(
            request,
            APIError(
                400,
                f"the request holds an integer of more than "
                f"{sys.get_int_max_str_digits()} digits; no field takes one that long",
            ),
        )
    return await _internal_error(request, e)


async def _not_found(request: Request, e):
    return _error(request, APIError(404, f"no route {request.method} {request.url.path}"))


async def _bad_method(request: Request, e):
    allow = (getattr(e, "headers", None) or {}).get("Allow")
    return _error(
        request,
        APIError(405, f"{request.method} is not allowed on {request.url.path}", type="invalid_request_error"),
        headers={"Allow": allow} if allow else None,
    )


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
