"""Serving logic shared by the chat and completions endpoints.

Readiness and model checks, sampling parameters, the engine request, and the two ways
of answering: one JSON object, or an SSE stream. The endpoint modules supply the prompt
token ids and a ResponseFormatter that shapes their own objects.
"""
from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from engine.wire import EngineReady, EngineRequest, RequestOutput, SamplingParams, SpecStats
from server.choices import FinishedChoice, close_generations, collect_choices, interleaved_deltas, merged_spec_stats
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
from server.generation import Delta, Generation, close_outputs
from server.protocol import MAX_SESSION_ID_LENGTH, PromptTokensDetails, SamplingFields, SpecStatsInfo, Usage
from server.response_store import ResponseStore
from server.sse import DONE_EVENT, EventStreamResponse, encode_event
from server.structured import response_format_grammar

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
        self.responses = ResponseStore(int(config.server.responses_store_mib * 2**20))  # the Responses API's

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
    """Shapes one endpoint's response objects and stream chunks; INDEX numbers the request's choices."""

    def role_chunk(self, index: int) -> BaseModel | None: ...
    def delta_chunk(self, index: int, delta: Delta) -> BaseModel | None: ...
    def finish_chunk(self, index: int, finish_reason: str, spec: SpecStatsInfo) -> BaseModel: ...
    def usage_chunk(self, usage: Usage, spec: SpecStatsInfo) -> BaseModel: ...
    def response(self, choices: list[FinishedChoice], usage: Usage, spec: SpecStatsInfo) -> BaseModel: ...


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def build_engine_requests(
    request_id: str,
    prompt_token_ids: list[int],
    body: SamplingFields,
    ready: EngineReady,
    http_request: Request,
    prompt_param: str,
    config: Config,
    grammar: str | None = None,
) -> list[EngineRequest]:
    """One engine request per choice (`n`); GRAMMAR (a forced tool call) or the response format constrains them.

    Choice i of a seeded request samples with seed + i, so the choices differ and each is reproducible; only the
    first choice continues the request's session (the others would each claim it).
    """
    max_tokens = resolve_max_tokens(body.effective_max_tokens, len(prompt_token_ids), ready, prompt_param)
    check_num_choices(body.num_choices, config.server.max_choices)
    if body.stream and body.num_prompt_logprobs is not None:
        raise APIError(400, "prompt log-probabilities are not streamed: send stream false",
                       param="prompt_logprobs" if body.prompt_logprobs is not None else "echo")
    if grammar is not None and body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, "response_format cannot be combined with a forced tool call", param="response_format")
    sampling = build_sampling_params(body, max_tokens, ready, grammar or response_format_grammar(body.response_format))
    session_id = body.session_id or session_id_header(http_request)
    return [
        EngineRequest(
            request_id=f"{request_id}-{index}" if body.num_choices > 1 else request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=_for_choice(sampling, index),
            session_id=session_id if index == 0 else None,
            prompt_source=f"{request_id}-0" if index else None,
            continues=continues_conversation(body),
        )
        for index in range(body.num_choices)
    ]


def continues_conversation(body: SamplingFields) -> bool:
    """Whether the request carries an earlier reply of its conversation (an assistant or tool message): a later turn,
    counted as a session hit or miss. A text completion does not say, so it counts as neither."""
    return any(message.role in ("assistant", "tool") for message in getattr(body, "messages", None) or ())


def check_num_choices(num_choices: int, max_choices: int) -> None:
    if num_choices > max_choices:
        raise APIError(400, f"n must be at most {max_choices} on this server, got {num_choices}", param="n")


def _for_choice(sampling: SamplingParams, index: int) -> SamplingParams:
    if index == 0 or sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=(sampling.seed + index) % 2**64)


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


def build_sampling_params(
    body: SamplingFields, max_tokens: int, ready: EngineReady, grammar: str | None = None,
) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0  # None/0/-1: off
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,  # 0 = greedy
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        seed=body.seed,
        max_tokens=max_tokens,
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logit_bias=logit_bias_by_id(body.logit_bias, ready.vocab_size),
        logprobs=body.num_logprobs,
        grammar=grammar,
        prompt_logprobs=body.num_prompt_logprobs,
    )


def logit_bias_by_id(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """The request's bias keyed by token id; 400 naming logit_bias for an id outside the vocabulary."""
    by_id = {int(key): bias for key, bias in (logit_bias or {}).items() if bias}
    unknown = [token_id for token_id in by_id if vocab_size and token_id >= vocab_size]
    if unknown:
        raise APIError(400, f"logit_bias names token {unknown[0]}, outside this model's vocabulary of {vocab_size}",
                       param="logit_bias")
    return by_id


def spec_stats_info(spec: SpecStats | None) -> SpecStatsInfo:
    spec = spec or SpecStats()
    return SpecStatsInfo(
        drafted_tokens=spec.num_draft_tokens,
        accepted_tokens=spec.num_accepted_tokens,
        num_drafts=spec.num_drafts,
        mean_acceptance_length=spec.mean_acceptance_length,
    )


def usage_of(num_prompt_tokens: int, generations: list[Generation]) -> Usage:
    """The prompt counted once, every choice's completion tokens."""
    num_completion_tokens = sum(generation.num_completion_tokens for generation in generations)
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=generations[0].num_cached_tokens),
    )


async def respond(
    context: ServingContext,
    http_request: Request,
    engine_requests: list[EngineRequest],
    body: SamplingFields,
    formatter: ResponseFormatter,
) -> Response:
    """Submit every choice to the engine and answer with a JSON object or an SSE stream."""
    generations = await start_generations(context, http_request, engine_requests, body)
    num_prompt_tokens = len(engine_requests[0].prompt_token_ids)
    close = functools.partial(close_generations, generations)
    if body.stream:
        events = stream_events(generations, formatter, num_prompt_tokens, body.include_usage)
        return EventStreamResponse(events, on_close=close)
    try:
        finished = await watch_disconnect(http_request, collect_choices(generations))
    finally:
        await close()
    usage = usage_of(num_prompt_tokens, generations)
    answer = formatter.response(finished, usage, spec_stats_info(merged_spec_stats(generations)))
    return JSONResponse(answer.model_dump(mode="json"))


async def start_generations(
    context: ServingContext, http_request: Request, engine_requests: list[EngineRequest], body: SamplingFields
) -> list[Generation]:
    """Start every choice; if one is refused (429/503), the others are closed and the refusal is the answer."""
    generations: list[Generation] = []
    try:
        for engine_request in engine_requests:
            generations.append(await start_generation(context, http_request, engine_request, body))
    except BaseException:
        await close_generations(generations)
        raise
    return generations


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
    return Generation(first, outputs, context.tokenizer, body.stop, body.scores_prompt_only)


async def _first_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    return await anext(outputs, None)


async def stream_events(
    generations: list[Generation], formatter: ResponseFormatter, num_prompt_tokens: int, include_usage: bool
) -> AsyncIterator[str]:
    """SSE events: role chunks, delta chunks of the choices as they come, a finish chunk per choice, an optional
    usage chunk, [DONE]."""
    for index in range(len(generations)):
        role_chunk = formatter.role_chunk(index)
        if role_chunk is not None:
            yield encode_event(role_chunk)
    try:
        async for index, delta in interleaved_deltas(generations):
            for event in _choice_events(formatter, index, delta, generations[index]):
                yield event
        if include_usage:
            usage = usage_of(num_prompt_tokens, generations)
            yield encode_event(formatter.usage_chunk(usage, spec_stats_info(merged_spec_stats(generations))))
    except Exception as exc:  # the response has started: report in-band
        yield encode_event(error_of_exception(exc).body())
    yield DONE_EVENT


def _choice_events(formatter: ResponseFormatter, index: int, delta: Delta | None, generation: Generation) -> list[str]:
    """A choice's delta chunk, or its finish chunk when DELTA is None (the choice ended)."""
    if delta is None:
        return [encode_event(formatter.finish_chunk(index, generation.finish_reason, spec_stats_info(generation.spec)))]
    chunk = formatter.delta_chunk(index, delta)
    return [encode_event(chunk)] if chunk is not None else []


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
