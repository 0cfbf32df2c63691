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
        (chat(n=2), "n", "only n=1 is supported"),
        (chat(n=0), "n", "only n=1 is supported"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (chat(stop=[1]), "stop", "string or a list of strings"),
        (chat(stop=""), "stop", "must not be empty"),
        (chat(logprobs=True), "logprobs", "not supported"),
        (chat(tools=[{"type": "function"}]), "tools", "not supported"),
        (chat(frequency_penalty=0.5), "frequency_penalty", "not supported"),
        (chat(response_format={"type": "json_object"}), "response_format", "not supported"),
        ({"messages": []}, "messages", "at least 1 item"),
        ({}, "messages", "Field required"),
        ({"messages": "hi"}, "messages", "valid list"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "'system', 'user'"),
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
        ({"prompt": "x", "echo": True}, "echo", "not supported"),
        ({"prompt": "x", "logprobs": 1}, "logprobs", "not supported"),
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
    [({"max_tokens": 7}, 7), ({"max_completion_tokens": 5}, 5), ({"max_tokens": 7, "max_completion_tokens": 5}, 5), ({}, None)],
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
