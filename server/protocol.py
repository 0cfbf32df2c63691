"""Pydantic models of the OpenAI chat and completions requests, responses and stream chunks.

Requests ignore unknown fields (OpenAI clients send many) but reject, with a clear
message, the fields we would otherwise silently get wrong (legacy `functions`, `suffix`,
`best_of`). Union-typed fields are normalised by before-validators so that a
bad value yields one clean error naming the field.
"""
from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_serializer, model_validator

MAX_NUM_STOP = 4
ROLES = ("system", "user", "assistant", "developer", "tool")
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule; also keeps names safe inside grammars and tags
TOOL_CHOICE_MODES = ("none", "auto", "required")
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_SESSION_ID_LENGTH = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions' `logprobs` takes the same here (OpenAI: 5)
MAX_LOGIT_BIAS = 100.0

# field -> (is the value unsupported?, message)
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "functions": (bool, "the legacy `functions` field is not supported; send `tools`"),
    "suffix": (bool, "suffix is not supported"),
    "best_of": (lambda v: v not in (None, 1), "best_of > 1 is not supported"),
}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")  # True: any JSON value
    strict: bool | None = None  # accepted; the schema is always enforced


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`, plus two forms llguidance gives for free: a regular expression and a Lark grammar."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None  # type "regex" (extension)
    grammar: str | None = None  # type "grammar" (extension): Lark syntax as llguidance reads it

    @model_validator(mode="after")
    def _has_its_field(self) -> ResponseFormat:
        needed = {"json_schema": self.json_schema, "regex": self.regex, "grammar": self.grammar}
        if self.type in needed and needed[self.type] is None:
            raise ValueError(f'type "{self.type}" needs the field "{self.type}"')
        return self


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
    n: int | None = Field(1, ge=1)  # choices; the server's --max-choices bounds it
    # extension: names the conversation
    session_id: str | None = Field(None, min_length=1, max_length=MAX_SESSION_ID_LENGTH)
    ignore_eos: bool = False  # extension: keep generating past EOS (benchmarks)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)  # extension (transformers, vLLM); 1 = off
    response_format: ResponseFormat | None = None
    # extension (vLLM): each prompt token's log-probability and its k most likely alternatives
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

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

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids written as strings, got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"biases must lie in [-100, 100], got {bias} for token {key}")
        return value

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def num_logprobs(self) -> int | None:
        """None: no log-probabilities; k: each token's and its k most likely alternatives."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """None: no prompt log-probabilities; k: each prompt token's and its k most likely alternatives."""
        return self.prompt_logprobs

    @property
    def scores_prompt_only(self) -> bool:
        """Whether the answer leaves the generated tokens out (completions' max_tokens 0)."""
        return False

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class FunctionCall(BaseModel):
    """A function the model called: `arguments` is JSON text (an object, if the model followed the schema)."""

    name: str
    arguments: str  # normalised from a JSON object, which some clients send back unserialised

    @field_validator("arguments", mode="before")
    @classmethod
    def _serialise_arguments(cls, value: Any) -> Any:
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value


class ToolCall(BaseModel):
    """One entry of an assistant message's `tool_calls` (in a reply, or sent back in the history)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | None = None  # normalised from str | list of {"type": "text", "text": ...}
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages only: the call this message answers

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

    @model_validator(mode="after")
    def _tool_fields_match_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self


def _text_of_part(part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise ValueError('only text content parts ({"type": "text", "text": ...}) are supported')
    if not isinstance(part.get("text"), str):
        raise ValueError("a text content part needs a string field 'text'")
    return part["text"]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None = no arguments
    strict: bool | None = None  # accepted; forced calls (server/tools.py) always follow the schema


class ToolDefinition(BaseModel):
    """An entry of the request's `tools`: only function tools exist in the chat API."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice {"type": "function", "function": {"name": ...}}: call this function."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None = auto
    parallel_tool_calls: bool | None = None  # None = true, as in OpenAI
    functions: list[Any] | None = None

    @field_validator("functions")
    @classmethod
    def _reject_unsupported_chat(cls, value: Any, info) -> Any:
        return _check_supported(info.field_name, value)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _normalise_tool_choice(cls, value: Any) -> Any:
        if value is None or value in TOOL_CHOICE_MODES:
            return value
        if isinstance(value, dict) and value.get("type", "function") == "function":
            function = value.get("function")
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                return NamedToolChoice(function=FunctionName(name=function["name"]))
        modes = ", ".join(repr(mode) for mode in TOOL_CHOICE_MODES)
        raise ValueError(f'must be one of {modes} or {{"type": "function", "function": {{"name": ...}}}}')

    @field_validator("tools")
    @classmethod
    def _unique_function_names(cls, tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        names = [tool.function.name for tool in tools or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"function names must be unique; repeated: {', '.join(repeated)}")
        return tools

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int]  # normalised from str | [int] | [str] | [[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False  # the prompt before the completion, with its log-probabilities when logprobs is set
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt only (lm-eval, vLLM)
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

    @field_validator("suffix", "best_of")
    @classmethod
    def _reject_unsupported_completion(cls, value: Any, info) -> Any:
        return _check_supported(info.field_name, value)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @property
    def scores_prompt_only(self) -> bool:
        """max_tokens 0: the engine generates one token, which the answer leaves out."""
        return self.max_tokens == 0

    @property
    def effective_max_tokens(self) -> int | None:
        return 1 if self.scores_prompt_only else self.max_tokens


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
    content: str | None  # None when the reply is only tool calls
    tool_calls: list[ToolCall] | None = None  # left out of the JSON when there are none

    @model_serializer(mode="wrap")
    def _omit_absent_tool_calls(self, serialize) -> dict:
        data = serialize(self)
        if self.tool_calls is None:
            data.pop("tool_calls", None)
        return data


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes (a token may hold part of a character)


class TokenLogprobInfo(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobInfo] | None = None
    refusal: list[TokenLogprobInfo] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: a token's log-probability, its rank in the distribution (1 = most likely)
    and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobList = list[dict[str, PromptLogprob] | None]  # per prompt token, keyed by token id; the first is None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str  # "stop" | "length" | "tool_calls"
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    spec_stats: SpecStatsInfo
    prompt_logprobs: PromptLogprobList | None = None  # extension (vLLM), when asked


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None  # a piece of the arguments' JSON text


class DeltaToolCall(BaseModel):
    """A stream's piece of one tool call; `index` numbers the calls of the choice (OpenAI's streaming shape)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None

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
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobList | None = None  # extension (vLLM), when asked


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
