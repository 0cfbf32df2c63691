"""POST /v1/chat/completions: chat template rendering and chat response shapes."""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import Response

from server.choices import FinishedChoice
from server.errors import APIError
from server.generation import Delta
from server.logprobs import LogprobFormatter
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
    ToolDefinition,
    Usage,
)
from server.serving import ServingContext, build_engine_requests, new_request_id, respond
from server.tools import ToolCallStreams, conversation_with_tools, offered_tools, tool_call_reply, tool_grammar

TEMPLATE_ROLES = {"developer": "system"}  # roles chat templates know under another name


async def create_chat_completion(
    context: ServingContext, body: ChatCompletionRequest, http_request: Request
) -> Response:
    ready = context.require_ready()
    model_name = context.check_model(body.model, ready)
    tools = offered_tools(body)
    prompt_token_ids = render_chat_prompt(context.tokenizer, body.messages, tools)
    grammar = tool_grammar(body.tools, body.tool_choice, body.parallel_tool_calls)
    request_id = new_request_id("chatcmpl")
    engine_requests = build_engine_requests(
        request_id, prompt_token_ids, body, ready, http_request, prompt_param="messages", config=context.config,
        grammar=grammar,
    )
    tool_calls = ToolCallStreams() if tools else None
    formatter = ChatFormatter(request_id, model_name, LogprobFormatter(context.tokenizer), tool_calls,
                              body.prompt_logprobs)
    return await respond(context, http_request, engine_requests, body, formatter)


def render_chat_prompt(
    tokenizer: Any, messages: list[ChatMessage], tools: list[ToolDefinition] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of the conversation and offered tools, rendered by the model's chat template, ready for the reply
    (without the reply's opening where ADD_GENERATION_PROMPT is false)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    conversation, template_kwargs = conversation_with_tools(tokenizer, [_template_message(m) for m in messages], tools)
    try:
        rendered = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs
        )
    except (jinja2.TemplateError, ValueError) as exc:
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
    return _token_ids_of(rendered)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """The message as transformers chat templates take it (tool calls with JSON-text arguments)."""
    entry: dict[str, Any] = {"role": TEMPLATE_ROLES.get(message.role, message.role), "content": message.content or ""}
    if message.tool_calls:
        entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _token_ids_of(rendered: Any) -> list[int]:
    """apply_chat_template returns a list, or (transformers 5) a BatchEncoding with input_ids."""
    token_ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
    if token_ids and isinstance(token_ids[0], list):
        token_ids = token_ids[0]  # a batch of one
    return [int(t) for t in token_ids]


class ChatFormatter:
    """Shapes chat.completion objects and chat.completion.chunk events of one request."""

    def __init__(
        self, request_id: str, model_name: str, logprobs: LogprobFormatter, tool_calls: ToolCallStreams | None = None,
        num_prompt_logprobs: int | None = None,
    ) -> None:
        self._request_id = request_id
        self._model_name = model_name
        self._created = int(time.time())  # seconds since the epoch, shared by all chunks
        self._logprobs = logprobs
        self._tool_calls = tool_calls  # set when the request offers tools: replies are parsed for calls
        self._num_prompt_logprobs = num_prompt_logprobs  # vLLM's prompt_logprobs field, when the request set it

    def role_chunk(self, index: int) -> ChatCompletionChunk:
        return self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])

    def delta_chunk(self, index: int, delta: Delta) -> ChatCompletionChunk | None:
        message = self._tool_calls.delta(index, delta.text) if self._tool_calls else DeltaMessage(content=delta.text)
        if message is None and delta.logprobs is None:
            return None  # held back: it may open a tool call
        choice = ChatStreamChoice(index=index, delta=message or DeltaMessage(), logprobs=self._shaped(delta.logprobs))
        return self._chunk([choice])

    def finish_chunk(self, index: int, finish_reason: str, spec: SpecStatsInfo) -> ChatCompletionChunk:
        delta = DeltaMessage()
        if self._tool_calls:
            delta = self._tool_calls.final_delta(index) or delta
            finish_reason = self._tool_calls.finish_reason(index, finish_reason)
        choice = ChatStreamChoice(index=index, delta=delta, finish_reason=finish_reason)
        return self._chunk([choice], spec_stats=spec)

    def usage_chunk(self, usage: Usage, spec: SpecStatsInfo) -> ChatCompletionChunk:
        return self._chunk([], usage=usage, spec_stats=spec)

    def response(self, choices: list[FinishedChoice], usage: Usage, spec: SpecStatsInfo) -> ChatCompletionResponse:
        shaped = [self._choice(choice) for choice in choices]
        entries = choices[0].prompt_logprobs if choices and self._num_prompt_logprobs is not None else None
        return ChatCompletionResponse(
            id=self._request_id, created=self._created, model=self._model_name, choices=shaped, usage=usage,
            spec_stats=spec,
            prompt_logprobs=self._logprobs.prompt_logprobs(entries, self._num_prompt_logprobs) if entries else None,
        )

    def _choice(self, choice: FinishedChoice) -> ChatChoice:
        message, finish_reason = AssistantMessage(content=choice.text), choice.finish_reason
        if self._tool_calls:
            message, finish_reason = tool_call_reply(choice.text, finish_reason)
        return ChatChoice(index=choice.index, message=message, finish_reason=finish_reason,
                          logprobs=self._shaped(choice.logprobs))

    def _shaped(self, logprobs):
        return self._logprobs.chat(logprobs) if logprobs is not None else None

    def _chunk(self, choices: list[ChatStreamChoice], **extra: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._request_id, created=self._created, model=self._model_name, choices=choices, **extra
        )
