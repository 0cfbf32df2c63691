"""Serving logic shared by the chat and completions endpoints.

Readiness and model checks, sampling parameters, the engine request, and the two ways
of answering: one JSON object, or an SSE stream. The endpoint modules supply the prompt
token ids and a ResponseFormatter that shapes their own objects.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from engine.wire import EngineReady, EngineRequest, RequestOutput, SamplingParams, SpecStats
from server.config import Config
from server.engine_client import EngineClient
from server.errors import (
    SERVER_ERROR,
    APIError,
    ClientDisconnectedError,
    context_length_exceeded,
    engine_unavailable,
    error_of_exception,
    model_not_found,
    shutting_down,
)
from server.generation import Generation, close_outputs
from server.protocol import MAX_SESSION_ID_LENGTH, PromptTokensDetails, SamplingFields, SpecStatsInfo, Usage
from server.sse import DONE_EVENT, EventStreamResponse, encode_event

DISCONNECT_POLL_S = 0.5  # seconds between client-disconnect checks of non-streaming requests
SESSION_HEADER = "X-Session-ID"
RETRY_AFTER_S = 5  # told to clients while the engine restarts
T = TypeVar("T")


class ServingContext:
    """What the endpoints need: the config, the engine client and the tokenizer."""

    def __init__(self, config: Config, engine: EngineClient, tokenizer: Any) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.draining = False  # SIGTERM arrived: requests in flight finish, new ones get 503 (server/drain.py)

    def require_ready(self) -> EngineReady:
        if self.draining:
            raise shutting_down()
        ready = self.engine.ready
        if ready is None or not self.engine.healthy:
            raise engine_unavailable(retry_after_s=RETRY_AFTER_S if self.engine.live else None)
        return ready

    def served_model_name(self, ready: EngineReady) -> str:
        return self.config.server.served_model_name or ready.model_name

    def check_model(self, model: str | None, ready: EngineReady) -> str:
        """The served model name; 404 when the request names another model."""
        served = self.served_model_name(ready)
        if model is not None and model != served:
            raise model_not_found(model)
        return served


class ResponseFormatter(Protocol):
    """Shapes one endpoint's response objects and stream chunks."""

    def role_chunk(self) -> BaseModel | None: ...
    def text_chunk(self, text: str) -> BaseModel: ...
    def finish_chunk(self, finish_reason: str, spec: SpecStatsInfo) -> BaseModel: ...
    def usage_chunk(self, usage: Usage, spec: SpecStatsInfo) -> BaseModel: ...
    def response(self, text: str, finish_reason: str, usage: Usage, spec: SpecStatsInfo) -> BaseModel: ...


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def build_engine_request(
    request_id: str,
    prompt_token_ids: list[int],
    body: SamplingFields,
    ready: EngineReady,
    http_request: Request,
    prompt_param: str,
) -> EngineRequest:
    max_tokens = resolve_max_tokens(body.effective_max_tokens, len(prompt_token_ids), ready, prompt_param)
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling=build_sampling_params(body, max_tokens, ready),
        session_id=body.session_id or session_id_header(http_request),
    )


def session_id_header(http_request: Request) -> str | None:
    """The `X-Session-ID` header; 400 when it is empty or too long."""
    value = http_request.headers.get(SESSION_HEADER)
    if value is not None and not 0 < len(value) <= MAX_SESSION_ID_LENGTH:
        raise APIError(400, f"{SESSION_HEADER} must have 1 to {MAX_SESSION_ID_LENGTH} characters", param=SESSION_HEADER)
    return value


def resolve_max_tokens(
    requested: int | None, num_prompt_tokens: int, ready: EngineReady, prompt_param: str
) -> int:
    """The requested completion budget, or all the context left; 400 when it does not fit."""
    room = ready.max_model_len - num_prompt_tokens
    if room < 1 or (requested is not None and requested > room):
        raise context_length_exceeded(ready.max_model_len, num_prompt_tokens, requested, prompt_param)
    return room if requested is None else requested


def build_sampling_params(body: SamplingFields, max_tokens: int, ready: EngineReady) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0  # None/0/-1: off
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,  # 0 = greedy
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        seed=body.seed,
        max_tokens=max_tokens,
        ignore_eos=body.ignore_eos,
    )


def spec_stats_info(spec: SpecStats | None) -> SpecStatsInfo:
    spec = spec or SpecStats()
    return SpecStatsInfo(
        drafted_tokens=spec.num_draft_tokens,
        accepted_tokens=spec.num_accepted_tokens,
        num_drafts=spec.num_drafts,
        mean_acceptance_length=spec.mean_acceptance_length,
    )


def usage_of(num_prompt_tokens: int, generation: Generation) -> Usage:
    num_completion_tokens = generation.num_completion_tokens
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=generation.num_cached_tokens),
    )


async def respond(
    context: ServingContext,
    http_request: Request,
    engine_request: EngineRequest,
    body: SamplingFields,
    formatter: ResponseFormatter,
) -> Response:
    """Submit to the engine and answer with a JSON object or an SSE stream."""
    generation = await start_generation(context, http_request, engine_request, body)
    num_prompt_tokens = len(engine_request.prompt_token_ids)
    if body.stream:
        events = stream_events(generation, formatter, num_prompt_tokens, body.include_usage)
        return EventStreamResponse(events, on_close=generation.aclose)
    try:
        text = await watch_disconnect(http_request, generation.text())
    finally:
        await generation.aclose()
    usage = usage_of(num_prompt_tokens, generation)
    answer = formatter.response(text, generation.finish_reason, usage, spec_stats_info(generation.spec))
    return JSONResponse(answer.model_dump(mode="json"))


async def start_generation(
    context: ServingContext, http_request: Request, engine_request: EngineRequest, body: SamplingFields
) -> Generation:
    """Submit and await the first output, so admission errors (429/503) precede the response."""
    outputs = context.engine.generate(engine_request)
    try:
        first = await watch_disconnect(http_request, _first_output(outputs))
    except BaseException:
        await close_outputs(outputs)
        raise
    if first is None:
        raise APIError(500, "the engine ended the request without output", SERVER_ERROR)
    return Generation(first, outputs, context.tokenizer, body.stop)


async def _first_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    return await anext(outputs, None)


async def stream_events(
    generation: Generation, formatter: ResponseFormatter, num_prompt_tokens: int, include_usage: bool
) -> AsyncIterator[str]:
    """SSE events: role chunk, text chunks, finish chunk, optional usage chunk, [DONE]."""
    role_chunk = formatter.role_chunk()
    if role_chunk is not None:
        yield encode_event(role_chunk)
    try:
        async for text in generation.deltas():
            yield encode_event(formatter.text_chunk(text))
        spec = spec_stats_info(generation.spec)
        yield encode_event(formatter.finish_chunk(generation.finish_reason, spec))
        if include_usage:
            yield encode_event(formatter.usage_chunk(usage_of(num_prompt_tokens, generation), spec))
    except Exception as exc:  # the response has started: report in-band
        yield encode_event(error_of_exception(exc).body())
    yield DONE_EVENT


async def watch_disconnect(http_request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable` in a task; cancel it and raise if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http_request.is_disconnected():
                raise ClientDisconnectedError()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
