"""The server's routes: each reads the app's state (``request.app.state``, set by app.py's lifespan)
and hands the request to its endpoint's serving object.

NOTE: bodies are read and parsed by the serving objects (size limit first, parsing off the event
loop); each route declares its body's model so /openapi.json describes it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from irminsul.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    PublishRequest,
    TokenizeRequest,
)
from irminsul.server.protocol_responses import ResponsesRequest

router = APIRouter()


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


@router.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
async def chat_completions(request: Request):
    return await request.app.state.serving_chat.create(request)


@router.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
async def completions(request: Request):
    return await request.app.state.serving_completion.create(request)


@router.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
async def responses(request: Request):
    return await request.app.state.serving_responses.create(request)


@router.post("/v1/cache/chunks", openapi_extra=body_schema(PublishRequest))
async def publish(request: Request):
    return await request.app.state.serving_publish.create(request)


def model_card(state) -> ModelCard:
    return ModelCard(
        id=state.model_name,
        created=int(state.started),
        max_model_len=state.context,
        irminsul={"reuse": state.client.reuse, "store": list(state.config.store.specs)},
    )


@router.get("/v1/models")
async def models(request: Request):
    return ModelList(data=[model_card(request.app.state.irminsul)]).model_dump()


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str):
    state = request.app.state.irminsul
    state.check_model(model_id)
    return model_card(state).model_dump()


@router.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
async def tokenize(request: Request):
    """vLLM's: {"prompt": str} or {"messages": [...]} (rendered with the chat template) -> token ids."""
    return await request.app.state.serving_tokenization.tokenize(request)


@router.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest))
async def detokenize(request: Request):
    return await request.app.state.serving_tokenization.detokenize(request)


@router.get("/health")
async def health(request: Request):
    if not request.app.state.irminsul.client.alive:
        return JSONResponse({"status": "engine thread stopped"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    state = request.app.state.irminsul
    await state.client.refresh_stats()
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")
