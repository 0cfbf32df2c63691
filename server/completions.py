"""POST /v1/completions: prompt tokenization and text_completion response shapes."""
from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from server.errors import APIError
from server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, SpecStatsInfo, Usage
from server.serving import ServingContext, build_engine_request, new_request_id, respond


async def create_completion(
    context: ServingContext, body: CompletionRequest, http_request: Request
) -> Response:
    ready = context.require_ready()
    model_name = context.check_model(body.model, ready)
    prompt_token_ids = tokenize_prompt(context.tokenizer, body.prompt)
    request_id = new_request_id("cmpl")
    engine_request = build_engine_request(
        request_id, prompt_token_ids, body, ready, http_request, prompt_param="prompt"
    )
    formatter = CompletionFormatter(request_id, model_name)
    return await respond(context, http_request, engine_request, body, formatter)


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

    def __init__(self, request_id: str, model_name: str) -> None:
        self._request_id = request_id
        self._model_name = model_name
        self._created = int(time.time())  # seconds since the epoch, shared by all chunks

    def role_chunk(self) -> None:
        return None  # completions have no role

    def text_chunk(self, text: str) -> CompletionResponse:
        return self._object([CompletionChoice(text=text)])

    def finish_chunk(self, finish_reason: str, spec: SpecStatsInfo) -> CompletionResponse:
        return self._object([CompletionChoice(text="", finish_reason=finish_reason)], spec_stats=spec)

    def usage_chunk(self, usage: Usage, spec: SpecStatsInfo) -> CompletionResponse:
        return self._object([], usage=usage, spec_stats=spec)

    def response(self, text: str, finish_reason: str, usage: Usage, spec: SpecStatsInfo) -> CompletionResponse:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return self._object([choice], usage=usage, spec_stats=spec)

    def _object(self, choices: list[CompletionChoice], **extra: Any) -> CompletionResponse:
        return CompletionResponse(
            id=self._request_id, created=self._created, model=self._model_name, choices=choices, **extra
        )
