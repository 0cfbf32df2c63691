"""POST /v1/completions: prompt tokenization and text_completion response shapes."""
from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from server.choices import FinishedChoice
from server.errors import APIError
from server.generation import Delta
from server.logprobs import LogprobFormatter
from server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, SpecStatsInfo, Usage
from server.serving import ServingContext, build_engine_requests, new_request_id, respond


async def create_completion(
    context: ServingContext, body: CompletionRequest, http_request: Request
) -> Response:
    ready = context.require_ready()
    model_name = context.check_model(body.model, ready)
    prompt_token_ids = tokenize_prompt(context.tokenizer, body.prompt)
    request_id = new_request_id("cmpl")
    engine_requests = build_engine_requests(
        request_id, prompt_token_ids, body, ready, http_request, prompt_param="prompt", config=context.config
    )
    formatter = CompletionFormatter(request_id, model_name, LogprobFormatter(context.tokenizer))
    return await respond(context, http_request, engine_requests, body, formatter)


def tokenize_prompt(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """Token ids of a text prompt (with the tokenizer's special tokens, e.g. BOS), or the ids given."""
    if isinstance(prompt, str):
        token_ids = list(tokenizer.encode(prompt, add_special_tokens=True))
    else:
        token_ids = _checked_token_ids(prompt, len(tokenizer))
    if not token_ids:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return token_ids


def _checked_token_ids(token_ids: list[int], vocab_size: int) -> list[int]:
    out_of_range = [t for t in token_ids if not 0 <= t < vocab_size]
    if out_of_range:
        message = f"prompt token ids must be in [0, {vocab_size}); got {out_of_range[0]}"
        raise APIError(400, message, param="prompt")
    return list(token_ids)


class CompletionFormatter:
    """Shapes text_completion objects and stream chunks of one request."""

    def __init__(self, request_id: str, model_name: str, logprobs: LogprobFormatter) -> None:
        self._request_id = request_id
        self._model_name = model_name
        self._created = int(time.time())  # seconds since the epoch, shared by all chunks
        self._logprobs = logprobs
        self._text_offsets: dict[int, int] = {}  # choice index -> characters streamed so far

    def role_chunk(self, index: int) -> None:
        return None  # completions have no role

    def delta_chunk(self, index: int, delta: Delta) -> CompletionResponse:
        offset = self._text_offsets.get(index, 0)
        self._text_offsets[index] = offset + len(delta.text)
        return self._object(
            [CompletionChoice(index=index, text=delta.text, logprobs=self._shaped(delta.logprobs, offset))]
        )

    def finish_chunk(self, index: int, finish_reason: str, spec: SpecStatsInfo) -> CompletionResponse:
        return self._object([CompletionChoice(index=index, text="", finish_reason=finish_reason)], spec_stats=spec)

    def usage_chunk(self, usage: Usage, spec: SpecStatsInfo) -> CompletionResponse:
        return self._object([], usage=usage, spec_stats=spec)

    def response(self, choices: list[FinishedChoice], usage: Usage, spec: SpecStatsInfo) -> CompletionResponse:
        shaped = [
            CompletionChoice(index=choice.index, text=choice.text, finish_reason=choice.finish_reason,
                             logprobs=self._shaped(choice.logprobs, 0))
            for choice in choices
        ]
        return self._object(shaped, usage=usage, spec_stats=spec)

    def _shaped(self, logprobs, text_offset: int):
        return self._logprobs.completion(logprobs, text_offset) if logprobs is not None else None

    def _object(self, choices: list[CompletionChoice], **extra: Any) -> CompletionResponse:
        return CompletionResponse(
            id=self._request_id, created=self._created, model=self._model_name, choices=choices, **extra
        )
