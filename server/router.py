"""The HTTP routes: chat and text completions, responses, the model list, tokenize and detokenize, and health."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from scheduler.sessions import SESSION_KINDS
from server.auth import require_api_key
from server.chat import create_chat_completion
from server.completions import create_completion
from server.errors import SERVER_ERROR, APIError, api_error_response, engine_unavailable, shutting_down
from server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from server.request_body import read_request
from server.responses import create_response, retrieve_response
from server.responses_protocol import ResponsesRequest
from server.serving import ServingContext
from server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

router = APIRouter()  # public: health
api_router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])  # the OpenAI API
token_router = APIRouter(dependencies=[Depends(require_api_key)])  # vLLM's /tokenize and /detokenize


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


@api_router.post("/responses")
async def responses(request: Request) -> Response:
    context = serving_context(request)
    body = await read_request(request, ResponsesRequest, context.config.server.max_request_bytes)
    return await create_response(context, body, request)


@api_router.get("/responses/{response_id}")
async def stored_response(request: Request, response_id: str) -> JSONResponse:
    return await retrieve_response(serving_context(request), response_id)


@api_router.get("/models")
async def list_models(request: Request) -> JSONResponse:
    context = serving_context(request)
    ready = context.require_ready()
    card = ModelCard(id=context.served_model_name(ready), max_model_len=ready.max_model_len)
    return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))


@token_router.post("/tokenize")
async def tokenize_route(request: Request) -> JSONResponse:
    context = serving_context(request)
    body = await read_request(request, TokenizeRequest, context.config.server.max_request_bytes)
    return await tokenize(context, body)


@token_router.post("/detokenize")
async def detokenize_route(request: Request) -> JSONResponse:
    context = serving_context(request)
    body = await read_request(request, DetokenizeRequest, context.config.server.max_request_bytes)
    return await detokenize(context, body)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    server_metrics = serving_context(request).engine.metrics
    if server_metrics is None:
        return api_error_response(APIError(404, "metrics are not enabled"))
    return Response(generate_latest(server_metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/health")
@router.get("/health/ready")
async def health(request: Request) -> JSONResponse:
    """Readiness: 200 while an engine is ready and the server admits requests; 503 (with the reason) otherwise."""
    context = serving_context(request)
    engine = context.engine
    if context.draining:
        return api_error_response(shutting_down())
    if engine.healthy:
        stats = engine.last_step_stats
        return JSONResponse({
            "status": "ok",
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "kv_cache_positions": engine.ready.num_kv_blocks * engine.ready.kv_block_size,  # the pool's size
            "num_sessions": stats.num_sessions,
            "drafter_state_bytes": stats.drafter_state_bytes,
            "session_host_bytes": stats.session_host_bytes,
            "session_hits": {kind: engine.session_hits[kind] for kind in SESSION_KINDS},
            "session_misses": {kind: engine.session_misses[kind] for kind in SESSION_KINDS},
            **supervision_fields(engine),
        })
    reason = engine.dead_reason or "the engine is still starting"
    return api_error_response(engine_unavailable(f"the engine is not ready: {reason}"))


@router.get("/health/live")
async def liveness(request: Request) -> JSONResponse:
    """Liveness: 200 while the server and its engine supervision work, also while an engine loads or restarts;
    503 once the server gave up restarting engines (it is about to exit)."""
    context = serving_context(request)
    engine = context.engine
    if not engine.live:
        return api_error_response(APIError(503, f"the server gave up: {engine.gave_up}", SERVER_ERROR, code="gave_up"))
    state = "draining" if context.draining else "ready" if engine.healthy else "starting"
    return JSONResponse({"status": "live", "engine": state, **supervision_fields(engine)})


def supervision_fields(engine) -> dict:
    return {"engine_restarts": engine.num_restarts, "last_engine_exit": engine.last_exit_reason}
