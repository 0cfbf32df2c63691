"""Validation of the OpenAI request models: what is accepted, normalised and rejected."""
from __future__ import annotations

import pydantic
import pytest

from server.errors import from_pydantic
from server.protocol import ChatCompletionRequest, CompletionRequest

USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"messages": USER, **fields}


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        (chat(temperature=2.5), "temperature", "less than or equal to 2"),
        (chat(temperature=-0.1), "temperature", "greater than or equal to 0"),
        (chat(top_p=0), "top_p", "greater than 0"),
        (chat(top_p=1.5), "top_p", "less than or equal to 1"),
        (chat(top_k=-2), "top_k", "greater than or equal to -1"),
        (chat(max_tokens=0), "max_tokens", "greater than or equal to 1"),
        (chat(max_completion_tokens=0), "max_completion_tokens", "greater than or equal to 1"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (chat(stop=[1]), "stop", "string or a list of strings"),
        (chat(stop=""), "stop", "must not be empty"),
        (chat(top_logprobs=3), "top_logprobs", "top_logprobs needs logprobs"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
        (chat(n=0), "n", "greater than or equal to 1"),
        (chat(logit_bias={"abc": 1}), "logit_bias", "token ids written as strings"),
        (chat(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
        (chat(presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
        (chat(repetition_penalty=0), "repetition_penalty", "greater than 0"),
        (chat(response_format={"type": "yaml"}), "response_format.type", "'json_object'"),
        (chat(response_format={"type": "json_schema"}), "response_format", 'needs the field "json_schema"'),
        (chat(functions=[{"name": "f"}]), "functions", "send `tools`"),
        (chat(tools=[{"type": "function"}]), "tools[0].function", "Field required"),
        (chat(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name", "pattern"),
        (chat(tools=[{"function": {"name": "f"}}, {"function": {"name": "f"}}]), "tools", "repeated: f"),
        (chat(tool_choice="any"), "tool_choice", "'required'"),
        (chat(tool_choice={"type": "function"}), "tool_choice", '"function": {"name": ...}'),
        ({"messages": []}, "messages", "at least 1 item"),
        ({}, "messages", "Field required"),
        ({"messages": "hi"}, "messages", "valid list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'system', 'user'"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "needs the tool_call_id"),
        ({"messages": [{"role": "tool", "tool_call_id": "c"}]}, "messages[0]", "needs content"),
        (
            {"messages": [{"role": "user", "content": "x",
                           "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]},
            "messages[0]",
            "only assistant messages",
        ),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "Field required"),
        ({"messages": [{"role": "user"}]}, "messages[0]", "needs content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "list of text parts"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "only text content parts",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content", "'text'"),
    ],
)
def test_invalid_chat_request_names_the_field(body, param, fragment):
    with pytest.raises(pydantic.ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    error = from_pydantic(info.value)
    assert error.status_code == 400
    assert error.param == param
    assert fragment in error.message


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"prompt": []}, "prompt", "non-empty list of token ids"),
        ({"prompt": [1, -2]}, "prompt", "token ids"),
        ({"prompt": [1, True]}, "prompt", "token ids"),
        ({"prompt": 5}, "prompt", "string or a non-empty list"),
        ({"prompt": ["a", "b"]}, "prompt", "batched prompts are not supported"),
        ({"prompt": [[1], [2]]}, "prompt", "batched prompts are not supported"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"prompt": "x", "best_of": 3}, "best_of", "not supported"),
        ({"prompt": "x", "suffix": "tail"}, "suffix", "not supported"),
        ({"prompt": "x", "temperature": 3}, "temperature", "less than or equal to 2"),
        ({"prompt": "x", "seed": "abc"}, "seed", "valid integer"),
        ({}, "prompt", "Field required"),
    ],
)
def test_invalid_completion_request_names_the_field(body, param, fragment):
    with pytest.raises(pydantic.ValidationError) as info:
        CompletionRequest.model_validate(body)
    error = from_pydantic(info.value)
    assert error.param == param
    assert fragment in error.message


def test_chat_request_defaults_and_normalisation():
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
            ],
            "stop": "END",
            "user": "someone",  # unknown OpenAI fields are ignored
            "logprobs": False,
            "tools": [],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert body.messages[0].content == "a\nb"
    assert body.messages[1].content is None
    assert body.stop == ["END"]
    assert (body.temperature, body.top_p, body.top_k, body.n) == (1.0, 1.0, None, 1)
    assert body.include_usage


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"max_tokens": 7}, 7),
        ({"max_completion_tokens": 5}, 5),
        ({"max_tokens": 7, "max_completion_tokens": 5}, 5),
        ({}, None),
    ],
)
def test_chat_max_completion_tokens_wins_over_max_tokens(fields, expected):
    assert ChatCompletionRequest.model_validate(chat(**fields)).effective_max_tokens == expected


def test_include_usage_needs_stream():
    assert not ChatCompletionRequest.model_validate(chat(stream_options={"include_usage": True})).include_usage


@pytest.mark.parametrize(
    "prompt, expected",
    [("hello", "hello"), ([1, 2, 3], [1, 2, 3]), (["hello"], "hello"), ([[4, 5]], [4, 5])],
)
def test_completion_prompt_forms(prompt, expected):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == expected


def test_top_k_minus_one_and_temperature_zero_are_valid():
    body = ChatCompletionRequest.model_validate(chat(top_k=-1, temperature=0, top_p=1, seed=3))
    assert (body.top_k, body.temperature, body.seed) == (-1, 0.0, 3)


def test_tools_tool_choice_and_tool_messages_are_accepted():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                *USER,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "20 C"}]},
            ],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
        }
    )
    assert body.messages[1].tool_calls[0].function.arguments == '{"city": "Paris"}'  # an object is serialised
    assert (body.messages[2].tool_call_id, body.messages[2].content) == ("call_1", "20 C")
    assert body.tools[0].function.parameters == {"type": "object"}
    assert body.tool_choice.function.name == "get_weather"
    assert body.parallel_tool_calls is False
    for mode in ("none", "auto", "required"):
        assert ChatCompletionRequest.model_validate(chat(tool_choice=mode)).tool_choice == mode
