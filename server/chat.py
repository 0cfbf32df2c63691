"""POST /v1/chat/completions: chat template rendering and chat response shapes."""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import Response

from server.errors import APIError
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    SpecStatsInfo,
    Usage,
)
from server.serving import ServingContext, build_engine_request, new_request_id, respond

TEMPLATE_ROLES = {"developer": "system"}  # roles chat templates know under another name


async def create_chat_completion(
    context: ServingContext, body: ChatCompletionRequest, http_request: Request
) -> Response:
    ready = context.require_ready()
    model_name = context.check_model(body.model, ready)
    prompt_token_ids = render_chat_prompt(context.tokenizer, body.messages)
    request_id = new_request_id("chatcmpl")
    engine_request = build_engine_request(
        request_id, prompt_token_ids, body, ready, http_request, prompt_param="messages"
    )
    return await respond(context, http_request, engine_request, body, ChatFormatter(request_id, model_name))


def render_chat_prompt(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    """Token ids of the conversation rendered by the model's chat template, ready for the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    conversation = [_template_message(m) for m in messages]
    try:
        rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    except (jinja2.TemplateError, ValueError) as exc:
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
    return _token_ids_of(rendered)


def _template_message(message: ChatMessage) -> dict[str, str]:
    return {"role": TEMPLATE_ROLES.get(message.role, message.role), "content": message.content or ""}


def _token_ids_of(rendered: Any) -> list[int]:
    """apply_chat_template returns a list, or (transformers 5) a BatchEncoding with input_ids."""
    token_ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
    if token_ids and isinstance(token_ids[0], list):
        token_ids = token_ids[0]  # a batch of one
    return [int(t) for t in token_ids]


class ChatFormatter:
    """Shapes chat.completion objects and chat.completion.chunk events of one request."""

    def __init__(self, request_id: str, model_name: str) -> None:
        self._request_id = request_id
        self._model_name = model_name
        self._created = int(time.time())  # seconds since the epoch, shared by all chunks

    def role_chunk(self) -> ChatCompletionChunk:
        return self._chunk([ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))])

    def text_chunk(self, text: str) -> ChatCompletionChunk:
        return self._chunk([ChatStreamChoice(delta=DeltaMessage(content=text))])

    def finish_chunk(self, finish_reason: str, spec: SpecStatsInfo) -> ChatCompletionChunk:
        choice = ChatStreamChoice(delta=DeltaMessage(), finish_reason=finish_reason)
        return self._chunk([choice], spec_stats=spec)

    def usage_chunk(self, usage: Usage, spec: SpecStatsInfo) -> ChatCompletionChunk:
        return self._chunk([], usage=usage, spec_stats=spec)

    def response(
        self, text: str, finish_reason: str, usage: Usage, spec: SpecStatsInfo
    ) -> ChatCompletionResponse:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return ChatCompletionResponse(
            id=self._request_id,
            created=self._created,
            model=self._model_name,
            choices=[choice],
            usage=usage,
            spec_stats=spec,
        )

    def _chunk(self, choices: list[ChatStreamChoice], **extra: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._request_id, created=self._created, model=self._model_name, choices=choices, **extra
        )
