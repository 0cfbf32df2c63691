"""POST /v1/responses and GET /v1/responses/{id}: the Responses API, served as a chat turn.

The turn is the chat endpoint's (server/responses_protocol.py builds its ChatCompletionRequest): the same template,
tool calls, grammars, sampling and speculation, so it is lossless under every drafter and counted by the same
metrics. The reply becomes output items: a `message` with its text, then a `function_call` per tool call.

`previous_response_id` continues a stored response: its conversation (in chat form) comes before the new input, and
the turn runs in the stored conversation's session, so it finds its KV and drafter state in the session cache
exactly as a conversation continued with `X-Session-ID` does. Without an explicit session id a stored response's
session is named after the first response of its conversation. An unknown id is a 404.
"""
from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from server.chat import render_chat_prompt
from server.choices import close_generations, collect_choices, interleaved_deltas
from server.errors import APIError, error_of_exception
from server.generation import Generation
from server.protocol import DeltaMessage, DeltaToolCall, ToolCall
from server.response_store import StoredResponse
from server.responses_protocol import ResponsesRequest, as_responses_error, chat_request
from server.serving import (
    ServingContext,
    build_engine_requests,
    session_id_header,
    start_generations,
    usage_of,
    watch_disconnect,
)
from server.sse import EventStreamResponse
from server.tools import ToolCallStreams, offered_tools, parse_tool_calls, tool_grammar


async def create_response(context: ServingContext, body: ResponsesRequest, http_request: Request) -> Response:
    ready = context.require_ready()
    model_name = context.check_model(body.model, ready)
    previous = _previous(context, body.previous_response_id)
    response_id = new_response_id("resp")
    session_id = body.session_id or session_id_header(http_request) or (
        previous.session_id if previous else response_id if body.store else None)
    chat, messages = chat_request(body, previous.messages if previous else [], session_id)
    tools = offered_tools(chat)
    try:
        prompt_token_ids = render_chat_prompt(context.tokenizer, chat.messages, tools)
        grammar = tool_grammar(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
        engine_requests = build_engine_requests(
            response_id, prompt_token_ids, chat, ready, http_request, prompt_param="input", config=context.config,
            grammar=grammar,
        )
    except APIError as error:
        raise as_responses_error(error) from None
    turn = Turn(context, body, response_id, model_name, messages, session_id, bool(tools))
    generations = await start_generations(context, http_request, engine_requests, chat)
    close = functools.partial(close_generations, generations)
    if body.stream:
        return EventStreamResponse(turn.events(generations, len(prompt_token_ids)), on_close=close)
    try:
        finished = await watch_disconnect(http_request, collect_choices(generations))
    finally:
        await close()
    output = output_items(finished[0].text, bool(tools))
    return JSONResponse(turn.finish(output, finished[0].finish_reason, len(prompt_token_ids), generations))


async def retrieve_response(context: ServingContext, response_id: str) -> JSONResponse:
    stored = context.responses.get(response_id)
    if stored is None:
        raise not_found(response_id, "response_id")
    return JSONResponse(stored.response)


def _previous(context: ServingContext, response_id: str | None) -> StoredResponse | None:
    if response_id is None:
        return None
    stored = context.responses.get(response_id)
    if stored is None:
        raise not_found(response_id, "previous_response_id")
    return stored


def not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"No response with id '{response_id}' is stored here (evicted, or stored false).",
                    param=param, code="response_not_found")


def new_response_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(reply: str, parses_tools: bool) -> list[dict[str, Any]]:
    """A whole reply's output items: a message item for its text, a function_call item per tool call (parsed as the
    chat endpoint parses them, when tools are offered)."""
    text, calls = parse_tool_calls(reply) if parses_tools else (reply, [])
    return ([message_item(text)] if text else []) + [function_call_item(call) for call in calls]


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_response_id("msg"), "status": status, "role": "assistant",
            "content": [output_text_part(text)] if status == "completed" else []}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call: ToolCall | DeltaToolCall) -> dict[str, Any]:
    return {"type": "function_call", "id": new_response_id("fc"), "call_id": call.id, "name": call.function.name,
            "arguments": call.function.arguments, "status": "completed"}


class Turn:
    """One response: its object, its stream of events, and what it stores."""

    def __init__(
        self, context: ServingContext, body: ResponsesRequest, response_id: str, model_name: str,
        messages: list[dict[str, Any]], session_id: str | None, parses_tools: bool,
    ) -> None:
        self.context, self.body, self.response_id, self.model_name = context, body, response_id, model_name
        self.messages, self.session_id, self.parses_tools = messages, session_id, parses_tools
        self.created_at = time.time()

    def response(self, status: str, output: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model_name, "output": output, "output_text": _output_text(output),
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "tools": [tool.model_dump() for tool in body.tools or []],
            "tool_choice": body.tool_choice_json, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text else
                                {"type": "text"})},
            "previous_response_id": body.previous_response_id, "store": body.store, "metadata": body.metadata or {},
            "truncation": "disabled", "error": None, "incomplete_details": None, "usage": None, **extra,
        }

    def finish(
        self, output: list[dict[str, Any]], finish_reason: str, num_prompt_tokens: int, generations: list[Generation],
    ) -> dict[str, Any]:
        """The final response object (stored when the request says so)."""
        incomplete = finish_reason == "length"
        response = self.response(
            "incomplete" if incomplete else "completed", output,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage=_usage(num_prompt_tokens, generations),
        )
        if self.body.store:
            self.context.responses.put(self.response_id, StoredResponse(
                response, self.messages + [_assistant_message(output)], self.session_id))
        return response

    async def events(self, generations: list[Generation], num_prompt_tokens: int) -> AsyncIterator[str]:
        """The stream: response.created, the output items' events as the reply arrives, response.completed (or
        .incomplete); an error after the stream started is an `error` event."""
        events = EventSequence()
        yield events.encode("response.created", response=self.response("in_progress", []))
        yield events.encode("response.in_progress", response=self.response("in_progress", []))
        streamer = ItemStream(events, self.parses_tools)
        try:
            async for _, delta in interleaved_deltas(generations):
                for event in streamer.on_text(delta.text if delta is not None else None):
                    yield event
            for event in streamer.close():
                yield event
            final = self.finish(streamer.output, generations[0].finish_reason, num_prompt_tokens, generations)
            yield events.encode(f"response.{final['status']}", response=final)
        except Exception as exc:  # the response has started: report in-band
            error = error_of_exception(exc)
            yield events.encode("error", code=error.code, message=error.message, param=error.param)


class EventSequence:
    """Numbers a stream's events (`sequence_number`) and encodes each as an SSE event named by its type."""

    def __init__(self) -> None:
        self.number = 0

    def encode(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ItemStream:
    """The events of a streamed reply's output items: text opens a message item and streams into it; a tool call
    closes the message and goes out as a function_call item, its arguments in one delta (the chat parser releases a
    call whole, server/tools.py)."""

    def __init__(self, events: EventSequence, parses_tools: bool) -> None:
        self.events = events
        self.tool_calls = ToolCallStreams() if parses_tools else None
        self.output: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item
        self._text = ""

    def on_text(self, text: str | None) -> list[str]:
        """The events TEXT releases; None ends the reply."""
        if text is None:
            message = self.tool_calls.final_delta(0) if self.tool_calls else None
        else:
            message = self.tool_calls.delta(0, text) if self.tool_calls else DeltaMessage(content=text)
        return self._released(message) if message is not None else []

    def close(self) -> list[str]:
        return self._close_message()

    def _released(self, message: DeltaMessage) -> list[str]:
        out = self._stream_text(message.content) if message.content else []
        for call in message.tool_calls or []:
            out += self._close_message() + self._function_call(call)
        return out

    def _stream_text(self, text: str) -> list[str]:
        out = []
        if self._message is None:
            self._message = message_item("", status="in_progress")
            index = len(self.output)
            out.append(self.events.encode("response.output_item.added", output_index=index, item=self._message))
            out.append(self.events.encode("response.content_part.added", item_id=self._message["id"],
                                          output_index=index, content_index=0, part=output_text_part("")))
        self._text += text
        out.append(self.events.encode("response.output_text.delta", item_id=self._message["id"],
                                      output_index=len(self.output), content_index=0, delta=text, logprobs=[]))
        return out

    def _close_message(self) -> list[str]:
        if self._message is None:
            return []
        item, index, text = message_item(self._text, item_id=self._message["id"]), len(self.output), self._text
        self._message, self._text = None, ""
        self.output.append(item)
        return [
            self.events.encode("response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text, logprobs=[]),
            self.events.encode("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=output_text_part(text)),
            self.events.encode("response.output_item.done", output_index=index, item=item),
        ]

    def _function_call(self, call: DeltaToolCall) -> list[str]:
        item, index = function_call_item(call), len(self.output)
        self.output.append(item)
        added = {**item, "arguments": "", "status": "in_progress"}
        return [
            self.events.encode("response.output_item.added", output_index=index, item=added),
            self.events.encode("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=item["arguments"]),
            self.events.encode("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"]),
            self.events.encode("response.output_item.done", output_index=index, item=item),
        ]


def _output_text(output: list[dict[str, Any]]) -> str:
    """What the SDKs' `output_text` gives: the text of every output_text part, joined."""
    return "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"]
                   if part["type"] == "output_text")


def _assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The reply as a chat assistant message, for the stored conversation."""
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": _output_text(output) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _usage(num_prompt_tokens: int, generations: list[Generation]) -> dict[str, Any]:
    usage = usage_of(num_prompt_tokens, generations)
    return {
        "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
    }

