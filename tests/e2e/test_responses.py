"""The Responses API through the official openai client, against the default server (CopySpec) and the plain one:
the same turn as the chat endpoint serves, streamed or not, function tools, stored responses continued by
previous_response_id in their session cache, and OpenAI's error bodies."""
import httpx
import openai
import pytest

from tests.e2e.conftest import PLAIN_API_KEY

MODEL = "SmolLM2-135M-Instruct"
INSTRUCTIONS = "You are a helpful assistant. Answer briefly."
QUESTION = ("Here is a list: apples, pears, plums, cherries, grapes. Repeat the list word for word, then say which "
            "fruit is red.")
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def plain_client(plain_server):
    from openai import OpenAI

    return OpenAI(base_url=plain_server.api_url, api_key=PLAIN_API_KEY, max_retries=0, timeout=120)


def respond(client, **kwargs):
    kwargs.setdefault("instructions", INSTRUCTIONS)
    kwargs.setdefault("input", QUESTION)
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_output_tokens", 48)
    return client.responses.create(model=MODEL, **kwargs)


def test_a_response_is_the_chat_turn_streamed_or_not_with_or_without_speculation(client, plain_client):
    reply = respond(client)
    assert reply.status in ("completed", "incomplete") and reply.output_text
    assert reply.output[0].type == "message" and reply.output[0].content[0].text == reply.output_text
    assert reply.usage.input_tokens > 0 and reply.usage.output_tokens > 0
    chat = client.chat.completions.create(model=MODEL, temperature=0.0, max_tokens=48, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert respond(plain_client).output_text == reply.output_text
    events = list(respond(client, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{reply.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == reply.output_text
    assert events[-1].response.output_text == reply.output_text


def test_a_function_tool_round_trip_through_previous_response_id(client):
    asked = respond(client, input="What is the weather like in Paris?", tools=[WEATHER], tool_choice="required",
                    parallel_tool_calls=False, max_output_tokens=64)
    calls = [item for item in asked.output if item.type == "function_call"]
    assert asked.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert '"city"' in calls[0].arguments
    with client.responses.stream(model=MODEL, instructions=INSTRUCTIONS, input="What is the weather like in Paris?",
                                 tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                 temperature=0.0, max_output_tokens=64) as stream:
        streamed = stream.get_final_response()
    assert [(item.name, item.arguments) for item in streamed.output if item.type == "function_call"] == [
        (calls[0].name, calls[0].arguments)]
    answered = respond(client, previous_response_id=asked.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 degrees Celsius"}])
    assert answered.output_text and answered.previous_response_id == asked.id
    assert answered.usage.input_tokens_details.cached_tokens > 0  # the conversation's KV, from its session


def test_previous_response_id_continues_the_conversation_as_its_session_would(client):
    """Turn 2 through previous_response_id reads turn 1's KV from the session cache and says what the same
    conversation says continued with X-Session-ID through the chat endpoint."""
    first = respond(client)
    second = respond(client, previous_response_id=first.id, input="Now only the yellow ones, if any.")
    history = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    turn_1 = client.chat.completions.create(model=MODEL, temperature=0.0, max_tokens=48, messages=history,
                                            extra_headers={"X-Session-ID": "responses-twin"})
    history += [{"role": "assistant", "content": turn_1.choices[0].message.content},
                {"role": "user", "content": "Now only the yellow ones, if any."}]
    turn_2 = client.chat.completions.create(model=MODEL, temperature=0.0, max_tokens=48, messages=history,
                                            extra_headers={"X-Session-ID": "responses-twin"})
    assert second.output_text == turn_2.choices[0].message.content
    assert second.usage.input_tokens == turn_2.usage.prompt_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached == turn_2.usage.prompt_tokens_details.cached_tokens and cached > first.usage.input_tokens // 2
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_unstored_and_unknown_responses_are_404s_with_openais_body(client, server):
    unstored = respond(client, store=False, max_output_tokens=4)
    for response_id in (unstored.id, "resp_does_not_exist"):
        with pytest.raises(openai.NotFoundError) as info:
            respond(client, previous_response_id=response_id)
        assert info.value.body["param"] == "previous_response_id"
        assert info.value.body["code"] == "response_not_found"
        assert httpx.get(f"{server.api_url}/responses/{response_id}").status_code == 404


@pytest.mark.parametrize("fields, param", [
    ({"input": [{"type": "message", "role": "wizard", "content": "hi"}]}, "input"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "function_call_output", "output": "no call id"}]}, "input"),
    ({"input": [{"type": "computer_call", "action": {}}]}, "input"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "function", "name": "absent"}, "tools": [WEATHER]}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "if": {}}}}}, "text"),
    ({"max_output_tokens": 100000}, "input"),  # context_length_exceeded, as the chat endpoint names messages
])
def test_bad_input_is_a_400_naming_the_parameter(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        respond(client, **fields)
    assert info.value.body["param"] == param
