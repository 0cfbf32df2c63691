"""The Responses API's input items as the chat conversation they stand for, the request as a chat request, and the
bounded store of responses."""
import pytest

from server.errors import APIError
from server.response_store import ResponseStore, StoredResponse
from server.responses_protocol import ResponsesRequest, chat_request, input_messages


def test_a_string_input_is_one_user_message():
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


def test_items_become_messages_with_function_calls_joining_the_assistant_turn():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "reasoning", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "Rain"}]},
    ]
    assert input_messages(items) == [
        {"role": "user", "content": "Weather\n?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "Rain"},
    ]


@pytest.mark.parametrize("item", [
    {"role": "wizard", "content": "x"},
    {"role": "user", "content": 5},
    {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
    {"type": "function_call", "name": "f", "arguments": "{}"},
    {"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}},
    {"type": "web_search_call"},
])
def test_a_bad_item_is_a_400_naming_input(item):
    with pytest.raises(APIError) as info:
        input_messages([item])
    assert info.value.status_code == 400 and info.value.param == "input"


def test_the_chat_request_carries_instructions_tools_format_and_budget():
    body = ResponsesRequest.model_validate({
        "input": "Go", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0, "store": False,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
    })
    history = [{"role": "user", "content": "Before"}, {"role": "assistant", "content": "Yes"}]
    chat, messages = chat_request(body, history, "s1")
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert messages == history + [{"role": "user", "content": "Go"}]  # stored without the system message
    assert chat.max_tokens == 9 and chat.session_id == "s1" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.name == "f" and chat.tool_choice.function.name == "f"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert body.tool_choice_json == {"type": "function", "name": "f"}


def test_only_function_tools_are_accepted():
    with pytest.raises(ValueError, match="only function tools"):
        ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "file_search"}]})


def test_the_store_keeps_its_byte_bound_evicting_the_oldest_first():
    def stored(n):
        return StoredResponse({"id": n, "pad": "x" * 100}, [{"role": "user", "content": "y" * 100}], None)

    size = stored("a").num_bytes
    store = ResponseStore(max_bytes=3 * size)
    for name in "abcd":
        store.put(name, stored(name))
    assert store.get("a") is None and [store.get(n).response["id"] for n in "bcd"] == ["b", "c", "d"]
    assert store.num_bytes == 3 * size and len(store) == 3
    store.put("huge", StoredResponse({"pad": "x" * 10 * size}, [], None))
    assert store.get("huge") is None and len(store) == 3
