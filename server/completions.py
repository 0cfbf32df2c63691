"""POST /v1/completions: prompt tokenization and text_completion response shapes."""
from __future__ import annotations

import time
from dataclasses import dataclass
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
    check_echo(body)
    prompt_token_ids = tokenize_prompt(context.tokenizer, body.prompt)
    request_id = new_request_id("cmpl")
    engine_requests = build_engine_requests(
        request_id, prompt_token_ids, body, ready, http_request, prompt_param="prompt", config=context.config
    )
    echo = Echo(prompt_text(context.tokenizer, body.prompt), prompt_token_ids, body.logprobs) if body.echo else None
    formatter = CompletionFormatter(request_id, model_name, LogprobFormatter(context.tokenizer), echo,
                                    body.prompt_logprobs)
    return await respond(context, http_request, engine_requests, body, formatter)


def check_echo(body: CompletionRequest) -> None:
    """max_tokens 0 only scores the prompt, so it needs echo; an echoed prompt is not streamed."""
    if body.scores_prompt_only and not body.echo:
        raise APIError(400, "max_tokens 0 needs echo true (the prompt is all the answer holds)", param="max_tokens")
    if body.echo and body.stream:
        raise APIError(400, "echo is not streamed: send stream false", param="echo")


def prompt_text(tokenizer: Any, prompt: str | list[int]) -> str:
    """The prompt as an echo shows it: the text sent, or the given token ids decoded."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


@dataclass
class Echo:
    """What an echoing request puts before each choice: the prompt's text and, when it asked for logprobs, the
    prompt tokens' entries with that many alternatives."""

    text: str
    token_ids: list[int]
    num_logprobs: int | None


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

    def __init__(
        self, request_id: str, model_name: str, logprobs: LogprobFormatter, echo: Echo | None = None,
        num_prompt_logprobs: int | None = None,
    ) -> None:
        self._request_id = request_id
        self._model_name = model_name
        self._created = int(time.time())  # seconds since the epoch, shared by all chunks
        self._logprobs = logprobs
        self._echo = echo
        self._num_prompt_logprobs = num_prompt_logprobs  # vLLM's prompt_logprobs field, when the request set it
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
        return self._object([self._choice(choice) for choice in choices], usage=usage, spec_stats=spec)

    def _choice(self, choice: FinishedChoice) -> CompletionChoice:
        prompt_logprobs = None
        if self._num_prompt_logprobs is not None and choice.prompt_logprobs:
            prompt_logprobs = self._logprobs.prompt_logprobs(choice.prompt_logprobs, self._num_prompt_logprobs)
        if self._echo is None:
            return CompletionChoice(index=choice.index, text=choice.text, finish_reason=choice.finish_reason,
                                    logprobs=self._shaped(choice.logprobs, 0), prompt_logprobs=prompt_logprobs)
        echo = self._echo
        logprobs = None
        if echo.num_logprobs is not None:
            logprobs = self._logprobs.echoed_prompt(echo.token_ids, choice.prompt_logprobs, echo.num_logprobs)
            generated = self._shaped(choice.logprobs or [], len(echo.text))
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(logprobs, name).extend(getattr(generated, name))
        return CompletionChoice(index=choice.index, text=echo.text + choice.text, finish_reason=choice.finish_reason,
                                logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _shaped(self, logprobs, text_offset: int):
        return self._logprobs.completion(logprobs, text_offset) if logprobs is not None else None

    def _object(self, choices: list[CompletionChoice], **extra: Any) -> CompletionResponse:
        return CompletionResponse(
            id=self._request_id, created=self._created, model=self._model_name, choices=choices, **extra
        )
