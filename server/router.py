"""The HTTP routes: chat and text completions, the model list, and health."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from fastapi.responses import JSONResponse, Response

from server.auth import require_api_key
from server.chat import create_chat_completion
from server.completions import create_completion
from server.errors import APIError, api_error_response, engine_unavailable
from server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from server.request_body import read_request
from server.serving import ServingContext

router = APIRouter()  # public: health
api_router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])  # the OpenAI API


def serving_context(request: Request) -> ServingContext:
    return request.app.state.serving


@api_router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    context = serving_context(request)
    body = await read_request(request, ChatCompletionRequest, context.config.server.max_request_bytes)
    return await create_chat_completion(context, body, request)


@api_router.post("/completions")
async def completions(request: Request) -> Response:
    context = serving_context(request)
    body = await read_request(request, CompletionRequest, context.config.server.max_request_bytes)
    return await create_completion(context, body, request)


@api_router.get("/models")
async def list_models(request: Request) -> JSONResponse:
    context = serving_context(request)
    ready = context.require_ready()
    card = ModelCard(id=context.served_model_name(ready), max_model_len=ready.max_model_len)
    return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    server_metrics = serving_context(request).engine.metrics
    if server_metrics is None:
        return api_error_response(APIError(404, "metrics are not enabled"))
    return Response(generate_latest(server_metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    engine = serving_context(request).engine
    if engine.ready is not None and engine.healthy:
        stats = engine.last_step_stats
        return JSONResponse({
            "status": "ok",
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_sessions": stats.num_sessions,
            "drafter_state_bytes": stats.drafter_state_bytes,
        })
    reason = engine.dead_reason or "the engine is still starting"
    return api_error_response(engine_unavailable(f"the engine is not ready: {reason}"))
