"""Logprobs, several choices, penalties, logit bias and structured outputs through the official openai client,
against two real servers: CopySpec (the default) and plain decoding. Speculation must change no greedy token and no
log-probability under any of them."""
import json

import jsonschema
import openai
import pytest

from tests.e2e.conftest import PLAIN_API_KEY

MODEL = "SmolLM2-135M-Instruct"
TEXT = ("The committee met on Tuesday to review the budget. It approved funding for the new library, "
        "postponed the decision on the park, and asked the treasurer for a revised forecast by March.")
REWRITE = [
    {"role": "user", "content": f"Here is a note:\n\n{TEXT}\n\nRewrite the note word for word, then add one sentence."},
]
SCHEMA = {
    "type": "object",
    "properties": {  # bounded, so that the grammar closes the object within max_tokens
        "summary": {"type": "string", "maxLength": 160},
        "decisions": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3},
    },
    "required": ["summary", "decisions"],
    "additionalProperties": False,
}
FEATURES = {
    "penalties": {"presence_penalty": 2.0, "frequency_penalty": 1.0},
    "repetition-penalty": {"extra_body": {"repetition_penalty": 1.15}},
    "logit-bias": {"logit_bias": {"260": 3, "30": -100}},  # " the" up, "." forbidden
    "json-schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "note", "schema": SCHEMA}},
                    "max_tokens": 200},
    "forced-tool-call": {"tools": [{"type": "function", "function": {"name": "record", "parameters": {
        "type": "object", "properties": {"decision": {"type": "string", "maxLength": 80}}, "required": ["decision"]}}}],
        "tool_choice": {"type": "function", "function": {"name": "record"}}, "parallel_tool_calls": False,
        "max_tokens": 100},
}


@pytest.fixture(scope="module")
def plain_client(plain_server):
    from openai import OpenAI

    return OpenAI(base_url=plain_server.api_url, api_key=PLAIN_API_KEY, max_retries=0, timeout=120)


def chat(client, **kwargs):
    kwargs.setdefault("messages", REWRITE)
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 64)
    return client.chat.completions.create(model=MODEL, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("feature", FEATURES)
def test_greedy_output_with_speculation_equals_plain_decoding(client, plain_client, feature):
    fields = FEATURES[feature]
    speculative, plain = chat(client, **fields).choices[0], chat(plain_client, **fields).choices[0]
    assert reply_of(speculative) == reply_of(plain)
    assert reply_of(plain) != reply_of(chat(plain_client).choices[0])  # the feature acted
    if feature == "forced-tool-call":
        assert plain.finish_reason == "tool_calls"
        assert "decision" in json.loads(plain.message.tool_calls[0].function.arguments)
    if feature == "json-schema":
        assert plain.finish_reason == "stop"
        jsonschema.validate(json.loads(plain.message.content), SCHEMA)
    if feature == "logit-bias":
        assert "." not in plain.message.content


def reply_of(choice) -> tuple:
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]
    return choice.message.content, calls


def test_speculation_is_at_work_on_the_rewrite(client):
    assert chat(client).model_extra["spec_stats"]["accepted_tokens"] > 0


def test_json_object_streams_valid_json(client):
    stream = chat(client, response_format={"type": "json_object"}, max_tokens=200, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict)


def test_logprobs_with_speculation_equal_plain_decoding_streamed_or_not(client, plain_client):
    speculative = chat(client, logprobs=True, top_logprobs=5).choices[0].logprobs.content
    plain = chat(plain_client, logprobs=True, top_logprobs=5).choices[0].logprobs.content
    assert [e.token for e in speculative] == [e.token for e in plain]
    assert [e.logprob for e in speculative] == pytest.approx([e.logprob for e in plain], abs=1e-4)
    assert all(len(e.top_logprobs) == 5 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in plain)
    assert all(e.logprob <= 0 for e in plain)
    streamed = [e for chunk in chat(client, logprobs=True, top_logprobs=5, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in speculative]


def test_completion_logprobs_name_the_tokens_of_the_text(client):
    reply = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=16, temperature=0.0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 16
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)


def test_several_choices_share_a_request_and_a_seed_reproduces_them(client):
    fields = {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 24, "messages": [
        {"role": "user", "content": "Write a short line about the sea."}]}
    reply = chat(client, **fields)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1  # choice i samples with seed + i
    assert [c.message.content for c in chat(client, **fields).choices] == [c.message.content for c in reply.choices]
    streamed = {0: "", 1: "", 2: ""}
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **fields))
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in range(3)] == [c.message.content for c in reply.choices]
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert reply.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in chat(client, logprobs=True, **fields).choices
    )


@pytest.mark.parametrize("fields, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 17}, "n"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}}}},
     "response_format"),
])
def test_bad_values_are_400s_naming_the_parameter(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **fields)
    assert info.value.body["param"] == param


def test_greedy_choices_that_share_the_prompts_kv_equal_a_single_choice(client):
    single = chat(client).choices[0].message.content
    assert [c.message.content for c in chat(client, n=3).choices] == [single] * 3

