"""Tool calls through the official openai client against a real specserve (embedded default model).

The default model (SmolLM2-135M-Instruct) was not tuned for tool calls, so these tests
force the call (tool_choice naming the function): the grammar makes its output a
well-formed call whatever the model would have written.
"""
import json

import jsonschema

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": WEATHER_PARAMETERS,
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The current time."}}
CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def chat(client, messages=QUESTION, **kwargs):
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], **kwargs)


def test_a_forced_named_call_has_arguments_that_follow_the_schema(client):
    choice = chat(client, tool_choice=CALL_WEATHER, parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


def test_a_streamed_forced_call_equals_the_returned_one(client):
    """One forced call (with parallel calls the model may start another and be cut short inside its tag, which then
    stays content, streamed or not)."""
    expected = chat(client, tool_choice=CALL_WEATHER, parallel_tool_calls=False).choices[0].message.tool_calls
    chunks = [
        chunk
        for chunk in chat(client, tool_choice=CALL_WEATHER, parallel_tool_calls=False, stream=True)
        if chunk.choices
    ]
    calls: dict[int, dict] = {}
    for delta in (chunk.choices[0].delta for chunk in chunks):
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": piece.id, "name": "", "arguments": ""})
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (call.function.name, call.function.arguments) for call in expected
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == ""
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices[0].finish_reason] == ["tool_calls"]
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMETERS)


def test_tool_results_in_the_history_are_accepted(client):
    called = chat(client, tool_choice=CALL_WEATHER, parallel_tool_calls=False).choices[0].message
    history = [
        *QUESTION,
        called.model_dump(exclude_none=True),  # sent back as the client got it
        {"role": "tool", "tool_call_id": called.tool_calls[0].id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    reply = chat(client, messages=history, max_tokens=30)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > 100  # the tools section and the call's result were rendered
    assert chat(client, messages=history, max_tokens=30, tool_choice="none").choices[0].message.tool_calls is None
