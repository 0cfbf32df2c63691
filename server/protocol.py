"""Pydantic models of the OpenAI chat and completions requests, responses and stream chunks.

Requests ignore unknown fields (OpenAI clients send many) but reject, with a clear
message, the fields we would otherwise silently get wrong (n > 1, logprobs, tools,
penalties, ...). Union-typed fields are normalised by before-validators so that a
bad value yields one clean error naming the field.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

MAX_NUM_STOP = 4
ROLES = ("system", "user", "assistant", "developer")
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_SESSION_ID_LENGTH = 256

# field -> (is the value unsupported?, message)
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "logprobs": (lambda v: v not in (None, False), "logprobs are not supported"),
    "tools": (bool, "tools / function calling is not supported"),
    "functions": (bool, "function calling is not supported"),
    "logit_bias": (bool, "logit_bias is not supported"),
    "frequency_penalty": (bool, "frequency_penalty is not supported (only 0)"),
    "presence_penalty": (bool, "presence_penalty is not supported (only 0)"),
    "response_format": (
        lambda v: v is not None and v.get("type", "text") != "text",
        "response_format other than text is not supported",
    ),
    "echo": (bool, "echo is not supported"),
    "suffix": (bool, "suffix is not supported"),
    "best_of": (lambda v: v not in (None, 1), "best_of > 1 is not supported"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and completions requests."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None = the served model
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extension; None, 0 and -1 mean off
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    max_tokens: int | None = Field(None, ge=1)
    stop: list[str] | None = None  # normalised from str | list[str]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    session_id: str | None = Field(None, min_length=1, max_length=MAX_SESSION_ID_LENGTH)  # extension: names the conversation
    ignore_eos: bool = False  # extension: keep generating past EOS (benchmarks)
    # accepted only with their "off" values:
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _normalise_stop(cls, value: Any) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if len(stops) > MAX_NUM_STOP:
            raise ValueError(f"takes at most {MAX_NUM_STOP} strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int | None) -> int:
        if value not in (None, 1):
            raise ValueError(f"only n=1 is supported, got n={value}; send one request per completion")
        return 1

    @field_validator("logit_bias", "frequency_penalty", "presence_penalty", "response_format")
    @classmethod
    def _reject_unsupported(cls, value: Any, info) -> Any:
        return _check_supported(info.field_name, value)

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | None = None  # normalised from str | list of {"type": "text", "text": ...}
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> str | None:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of text parts")
        return "\n".join(_text_of_part(part) for part in value)

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


def _text_of_part(part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise ValueError('only text content parts ({"type": "text", "text": ...}) are supported')
    if not isinstance(part.get("text"), str):
        raise ValueError("a text content part needs a string field 'text'")
    return part["text"]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None

    @field_validator("logprobs", "tools", "functions")
    @classmethod
    def _reject_unsupported_chat(cls, value: Any, info) -> Any:
        return _check_supported(info.field_name, value)

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int]  # normalised from str | [int] | [str] | [[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _normalise_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(_is_token_id(t) for t in value):
            return value
        if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
            raise ValueError("batched prompts are not supported; send one prompt per request")
        raise ValueError("must be a string or a non-empty list of token ids (ints >= 0)")

    @field_validator("logprobs", "echo", "suffix", "best_of")
    @classmethod
    def _reject_unsupported_completion(cls, value: Any, info) -> Any:
        return _check_supported(info.field_name, value)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_supported(field_name: str, value: Any) -> Any:
    is_unsupported, message = _UNSUPPORTED[field_name]
    if is_unsupported(value):
        raise ValueError(message)
    return value


# ---- responses -------------------------------------------------------------


class SpecStatsInfo(BaseModel):
    """Speculative-decoding stats of one request (extension field `spec_stats`)."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    num_drafts: int = 0
    mean_acceptance_length: float = 1.0  # 1 + accepted / drafts


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the session cache (prefill saved)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


def _now() -> int:
    return int(time.time())  # seconds since the epoch


class ResponseBase(BaseModel):
    id: str
    created: int = Field(default_factory=_now)
    model: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str  # "stop" | "length"
    logprobs: None = None


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    spec_stats: SpecStatsInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: None = None

    @field_serializer("delta")
    def _omit_unset_delta_fields(self, delta: DeltaMessage) -> dict:
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    spec_stats: SpecStatsInfo | None = None  # set on the final chunks


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class CompletionResponse(ResponseBase):
    """A text_completion object; stream chunks use the same shape with partial text."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    spec_stats: SpecStatsInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "specserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
