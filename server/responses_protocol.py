"""The Responses API request (POST /v1/responses) and its translation into the chat conversation specserve serves.

A response is a chat turn under another shape: `instructions` is the system message, `input` is a string (one user
message) or a list of items (messages with text parts, earlier `function_call`s, and `function_call_output`s that
answer them), `tools` are function tools without the chat API's `function` wrapper, and `text.format` is the chat
API's `response_format`. `chat_request` builds the ChatCompletionRequest the chat endpoint would get for the same
turn, so both endpoints render, constrain, sample and speculate identically. Bad items are 400s naming `input`.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from server.errors import APIError, from_pydantic
from server.protocol import (
    FUNCTION_NAME_PATTERN,
    MAX_SESSION_ID_LENGTH,
    SEED_MAX,
    SEED_MIN,
    TOOL_CHOICE_MODES,
    ChatCompletionRequest,
    FunctionName,
    NamedToolChoice,
)

INPUT_TEXT_PARTS = ("input_text", "output_text", "text")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
CHAT_TO_RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


class FunctionTool(BaseModel):
    """A Responses function tool: the chat API's function definition, flattened."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _only_function_tools(cls, value: Any) -> Any:
        if value != "function":
            raise ValueError(f"tools of type {value!r} are not supported: only function tools run here")
        return value


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = Field("response", max_length=64)
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extension, as on the chat endpoint
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # extension, as on the chat endpoint
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name": ...}; None = auto
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    session_id: str | None = Field(None, min_length=1, max_length=MAX_SESSION_ID_LENGTH)  # extension

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, value: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if not value:
            raise ValueError("must be a non-empty string or list of items")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _normalise_tool_choice(cls, value: Any) -> Any:
        if value is None or value in TOOL_CHOICE_MODES:
            return value
        if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
            return NamedToolChoice(function=FunctionName(name=value["name"]))
        modes = ", ".join(repr(mode) for mode in TOOL_CHOICE_MODES)
        raise ValueError(f'must be one of {modes} or {{"type": "function", "name": ...}}')

    @property
    def tool_choice_json(self) -> str | dict[str, str]:
        """tool_choice as a response echoes it."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return {"type": "function", "name": self.tool_choice.function.name}
        return self.tool_choice or "auto"


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]], session_id: str | None) -> tuple[
        ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request of this turn, and the turn's messages without the system message (what a stored response
    keeps so that a later turn can continue from it): HISTORY (a stored response's) then the input items."""
    messages = history + input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        "model": body.model, "messages": system + messages, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
        "stream": body.stream, "session_id": session_id, "parallel_tool_calls": body.parallel_tool_calls,
        "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel) else body.tool_choice,
    }
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
    if body.text is not None and body.text.format.type != "text":
        fields["response_format"] = _response_format(body.text.format)
    try:
        return ChatCompletionRequest.model_validate(fields), messages
    except ValidationError as exc:
        raise as_responses_error(from_pydantic(exc)) from exc


def as_responses_error(error: APIError) -> APIError:
    """ERROR of the chat request, naming the Responses parameter it came from."""
    head = re.split(r"[.\[]", error.param or "", maxsplit=1)[0]
    if head in CHAT_TO_RESPONSES_PARAMS:
        error.param = CHAT_TO_RESPONSES_PARAMS[head]
    return error


def _response_format(text_format: TextFormat) -> dict[str, Any]:
    if text_format.type == "json_object":
        return {"type": "json_object"}
    schema = True if text_format.schema_ is None else text_format.schema_
    return {"type": "json_schema", "json_schema": {"name": text_format.name, "schema": schema}}


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of a Responses `input`: consecutive function calls join the assistant turn before them."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, index))
        elif kind == "function_call":
            _append_call(messages, _function_call(item, index))
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", index),
                             "content": _text(item.get("output"), index)})
        elif kind != "reasoning":  # a reasoning item carries nothing this model reads
            raise APIError(400, f"input[{index}] has type {kind!r}: message, function_call and "
                           "function_call_output items are supported", param="input")
    return messages


def _message(item: dict[str, Any], index: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise APIError(400, f"input[{index}].role must be one of {', '.join(MESSAGE_ROLES)}", param="input")
    return {"role": role, "content": _text(item.get("content"), index)}


def _function_call(item: dict[str, Any], index: int) -> dict[str, Any]:
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise APIError(400, f"input[{index}].arguments must be JSON text", param="input")
    return {"id": _field(item, "call_id", index), "type": "function",
            "function": {"name": _field(item, "name", index), "arguments": arguments}}


def _append_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _field(item: dict[str, Any], name: str, index: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"input[{index}] needs a string field {name!r}", param="input")
    return value


def _text(content: Any, index: int) -> str:
    """A message's text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{index}].content must be a string or a list of text parts", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in INPUT_TEXT_PARTS or not isinstance(
                part.get("text"), str):
            raise APIError(400, f"input[{index}].content: only text parts (input_text, output_text) are supported",
                           param="input")
        texts.append(part["text"])
    return "\n".join(texts)
