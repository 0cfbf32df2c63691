"""Tool calls: Hermes rendering with the default template, parsing (whole and streamed), and the forcing grammar."""
from __future__ import annotations

import json
import random

import llguidance.hf
import openai.types.chat as openai_chat
import pytest
from llguidance import LLMatcher

from server.chat import ChatFormatter, render_chat_prompt
from server.choices import FinishedChoice
from server.errors import APIError
from server.generation import Delta
from server.logprobs import LogprobFormatter
from server.protocol import ChatCompletionRequest, SpecStatsInfo, Usage
from server.tools import (
    ToolCallParser,
    ToolCallStreams,
    conversation_with_tools,
    offered_tools,
    parse_tool_calls,
    template_renders_tools,
    tool_grammar,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: called with {}
TOOLS_SECTION_START = "# Tools\n\nYou may call one or more functions to assist with the user query."
CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL_TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def request(messages, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": messages, **fields})


def tools(*definitions):
    return request([{"role": "user", "content": "x"}], tools=list(definitions)).tools


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def rendered_text(tokenizer, messages, **fields) -> str:
    body = request(messages, **fields)
    return tokenizer.decode(render_chat_prompt(tokenizer, body.messages, offered_tools(body)))


# ---- rendering -------------------------------------------------------------------


def test_the_default_template_does_not_render_tools_so_we_do(tokenizer):
    assert not template_renders_tools(tokenizer)
    text = rendered_text(tokenizer, [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, TIME])
    listing = "\n".join(json.dumps(tool) for tool in (WEATHER, TIME))
    assert text.startswith(f"<|im_start|>system\n{TOOLS_SECTION_START}")
    assert f"<tools>\n{listing}\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>' in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_the_tools_section_is_appended_to_the_system_message(tokenizer):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = rendered_text(tokenizer, messages, tools=[TIME])
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{TOOLS_SECTION_START}")
    assert text.count("<|im_start|>system") == 1


def test_tool_choice_none_leaves_the_tools_out(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    assert rendered_text(tokenizer, messages, tools=[WEATHER], tool_choice="none") == rendered_text(tokenizer, messages)


def test_calls_and_results_in_the_history_render_in_the_hermes_format(tokenizer):
    call = tool_call("call_1", "get_weather", '{"city": "Paris", "unit": "celsius"}')
    messages = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call, tool_call("call_2", "get_time", "{}")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        {"role": "assistant", "content": "Let me check again.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    text = rendered_text(tokenizer, messages, tools=[WEATHER, TIME])
    assert text.endswith(
        "<|im_start|>user\nWeather and time in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL_PARIS}\n{CALL_TIME}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\nLet me check again.\n{CALL_PARIS}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_without_tools_the_conversation_is_left_alone(tokenizer):
    conversation = [{"role": "user", "content": "Hi"}]
    assert conversation_with_tools(tokenizer, conversation, None) == (conversation, {})


def test_a_template_that_knows_tools_gets_them_and_argument_objects():
    class ToolTemplate:
        chat_template = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}"

    conversation = [
        {"role": "assistant", "content": "", "tool_calls": [tool_call("c", "get_weather", '{"city": "Rome"}')]},
        {"role": "tool", "content": "9 C", "tool_call_id": "c"},
    ]
    rendered, template_kwargs = conversation_with_tools(ToolTemplate(), conversation, tools(WEATHER))
    assert template_kwargs == {"tools": [WEATHER]}
    assert rendered[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert rendered[1] == conversation[1]


# ---- parsing ---------------------------------------------------------------------


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in tool_calls]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (CALL_PARIS, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        (
            f"{CALL_PARIS}\n{CALL_TIME}\n",
            None,
            [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})],
        ),
        (f"Checking.\n{CALL_TIME}", "Checking.", [("get_time", {})]),
        ('<tool_call>\n{"name": "get_time"}', None, [("get_time", {})]),  # cut before its closing tag
        ("Just text, <b>no calls</b>.\n", "Just text, <b>no calls</b>.\n", []),
        ("<tool_call>\nnot json\n</tool_call> ok", "<tool_call>\nnot json\n</tool_call> ok", []),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
        ('<tool_call>\n{"name": "get_time", "argu', '<tool_call>\n{"name": "get_time", "argu', []),
        ("ends with <tool_ca", "ends with <tool_ca", []),
    ],
)
def test_parse_tool_calls(text, content, calls):
    parsed_content, tool_calls = parse_tool_calls(text)
    assert parsed_content == content
    assert calls_of(tool_calls) == calls
    assert all(call.id.startswith("call_") and call.type == "function" for call in tool_calls)


def stream(pieces: list[str]):
    """What a parser releases for each piece, then at the end."""
    parser = ToolCallParser()
    return [parser.feed(piece) for piece in pieces] + [parser.finish()]


@pytest.mark.parametrize(
    "text",
    [
        f"Checking.\n{CALL_PARIS}\n{CALL_TIME}\n",
        "plain <tool answer> text\n",
        "<tool_call>\nbad\n</tool_call>",
        CALL_TIME[:-3],
    ],
)
def test_streamed_parsing_equals_whole_parsing_however_the_text_is_split(text):
    whole_content, whole_calls = parse_tool_calls(text)
    rng = random.Random(0)
    for pieces in ([text], list(text), *[random_split(text, rng) for _ in range(20)]):
        released = stream(pieces)
        content = "".join(part.content for part in released)
        assert (content or None if whole_calls else content) == whole_content
        assert calls_of([call for part in released for call in part.tool_calls]) == calls_of(whole_calls)


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(5, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_the_stream_holds_back_what_may_open_a_call_and_releases_each_call_when_it_closes():
    parser = ToolCallParser()
    assert parser.feed("Hello <tool_").content == "Hello"  # the space waits: it is dropped if only calls follow
    assert parser.feed("call>\n{\"name\": \"get_time\", ").content == ""
    released = parser.feed('"arguments": {}}\n</tool_call>')
    assert calls_of(released.tool_calls) == [("get_time", {})] and released.content == ""
    assert parser.feed(" more").content == "  more"  # with the held space: content goes on
    assert parser.feed("<to").content == "" and parser.feed("y>").content == "<toy>"
    assert parser.finish().content == ""


def test_the_chat_formatter_streams_and_returns_tool_calls_in_openais_shapes(tokenizer):
    text = f"Checking.\n{CALL_PARIS}\n{CALL_TIME}"
    formatter = ChatFormatter("chatcmpl-1", "m", LogprobFormatter(tokenizer), ToolCallStreams())
    chunks = [formatter.delta_chunk(0, Delta(piece)) for piece in random_split(text, random.Random(1))]
    chunks.append(formatter.finish_chunk(0, "stop", SpecStatsInfo()))
    streamed = [openai_chat.ChatCompletionChunk.model_validate(c.model_dump(mode="json")) for c in chunks if c]
    deltas = [chunk.choices[0].delta for chunk in streamed]
    assert "".join(delta.content or "" for delta in deltas) == "Checking."
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    assert [(call.index, call.function.name) for call in calls] == [(0, "get_weather"), (1, "get_time")]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"

    usage = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    reply = formatter.response(
        [FinishedChoice(0, text, "stop"), FinishedChoice(1, "No.", "stop")], usage, SpecStatsInfo()
    )
    reply = openai_chat.ChatCompletion.model_validate(reply.model_dump(mode="json"))
    called, answered = reply.choices
    assert called.finish_reason == "tool_calls" and called.message.content == "Checking."
    assert [call.function.name for call in called.message.tool_calls] == ["get_weather", "get_time"]
    assert (answered.finish_reason, answered.message.content, answered.message.tool_calls) == ("stop", "No.", None)


def test_a_reply_cut_short_keeps_finish_reason_length(tokenizer):
    formatter = ChatFormatter("chatcmpl-1", "m", LogprobFormatter(tokenizer), ToolCallStreams())
    usage = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    reply = formatter.response([FinishedChoice(0, f"{CALL_TIME}\n<tool_call>\n{{", "length")], usage, SpecStatsInfo())
    assert reply.choices[0].finish_reason == "length" and len(reply.choices[0].message.tool_calls) == 1


# ---- the forcing grammar -----------------------------------------------------------


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    return llguidance.hf.from_tokenizer(tokenizer)


def accepts(grammar: str, text: str, tokenizer, ll_tokenizer) -> bool:
    """Whether the grammar takes `text` as a whole output, EOS allowed after it."""
    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    if matcher.validate_tokens(token_ids) != len(token_ids) or not matcher.consume_tokens(token_ids):
        return False
    return matcher.is_accepting() and matcher.consume_token(tokenizer.eos_token_id)


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_no_grammar_unless_a_call_is_forced(tool_choice):
    assert tool_grammar(tools(WEATHER), tool_choice, None) is None
    assert tool_grammar(None, tool_choice, None) is None


def test_required_admits_calls_of_any_tool_with_valid_arguments(tokenizer, ll_tokenizer):
    grammar = tool_grammar(tools(WEATHER, TIME), "required", None)
    for text in (CALL_PARIS, CALL_TIME, f"{CALL_TIME}\n{CALL_PARIS}"):
        assert accepts(grammar, text, tokenizer, ll_tokenizer), text
    for text in (
        "Sure!",
        "",
        CALL_PARIS.replace("celsius", "kelvin"),  # not in the enum
        CALL_PARIS.replace(', "unit": "celsius"', ""),  # a required argument missing
        CALL_PARIS.replace('"celsius"}', '"celsius", "extra": 1}'),  # additionalProperties false
        CALL_PARIS.replace("get_weather", "get_wether"),  # not a tool
        CALL_PARIS.replace('{"city": "Paris"', '{ "city": "Paris"'),  # compact JSON only
        CALL_TIME.replace("{}", '{"zone": "UTC"}'),  # no parameters: no arguments
        CALL_PARIS + " and more",
    ):
        assert not accepts(grammar, text, tokenizer, ll_tokenizer), text


def test_a_named_tool_choice_admits_only_that_function(tokenizer, ll_tokenizer):
    body = request([{"role": "user", "content": "x"}], tools=[WEATHER, TIME], tool_choice=named("get_time"))
    grammar = tool_grammar(body.tools, body.tool_choice, body.parallel_tool_calls)
    assert accepts(grammar, CALL_TIME, tokenizer, ll_tokenizer)
    assert not accepts(grammar, CALL_PARIS, tokenizer, ll_tokenizer)


def test_parallel_tool_calls_false_admits_one_call(tokenizer, ll_tokenizer):
    grammar = tool_grammar(tools(WEATHER, TIME), "required", False)
    assert accepts(grammar, CALL_TIME, tokenizer, ll_tokenizer)
    assert not accepts(grammar, f"{CALL_TIME}\n{CALL_TIME}", tokenizer, ll_tokenizer)


def test_forced_calls_parse_back_into_the_call():
    content, tool_calls = parse_tool_calls(CALL_PARIS)
    assert content is None and calls_of(tool_calls) == [("get_weather", {"city": "Paris", "unit": "celsius"})]


@pytest.mark.parametrize(
    "offered, tool_choice, param, fragment",
    [
        ([WEATHER], named("get_time"), "tool_choice", "`get_time`"),
        ([], "required", "tool_choice", "requires tools"),
        ([{"function": {"name": "f", "parameters": {"type": "strin"}}}], "required", "tools", "Invalid type"),
    ],
)
def test_tool_choice_and_schemas_that_cannot_be_forced_are_400(offered, tool_choice, param, fragment):
    body = request([{"role": "user", "content": "x"}], tools=offered, tool_choice=tool_choice)
    with pytest.raises(APIError) as info:
        tool_grammar(body.tools, body.tool_choice, body.parallel_tool_calls)
    assert (info.value.status_code, info.value.param) == (400, param)
    assert fragment in info.value.message
