"""Tool calls for POST /v1/chat/completions: rendered into the prompt, parsed out of the reply, forced by a grammar.

One format, Hermes / Qwen2.5 (what most open chat models are tuned on): the offered tools are listed, as OpenAI
tool JSON, inside `<tools></tools>` in a system-message section that asks for `<tool_call>` blocks; a call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several calls being blocks separated by newlines; a
tool's result comes back as a user turn holding `<tool_response>\\n...\\n</tool_response>` (consecutive tool
messages share one turn).

Rendering prefers the model's own template: when it references `tools` (Qwen2.5, Hermes, Llama 3.1 ...), the
messages and tools go to `apply_chat_template` in the transformers shape and the template decides the format.
Otherwise (the default SmolLM2 ChatML template knows nothing of tools) the conversation is rewritten into plain
messages in the Hermes format. Either way the reply is parsed for Hermes `<tool_call>` JSON blocks only.
tool_choice "required" or a named function is enforced, not requested: an llguidance grammar (the engine masks every
position with it, drafted ones included) admits only `<tool_call>` blocks of the allowed functions whose arguments
follow their schemas.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from llguidance import LLMatcher

from server.errors import APIError
from server.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
)
from server.structured import JSON_OPTIONS, check_grammar

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
NO_ARGUMENTS_SCHEMA = {"type": "object", "properties": {}, "additionalProperties": False}
# Forced arguments are compact JSON with json.dumps's separators (so a call sent back in the history
# renders as generated), and schema keywords llguidance does not implement are ignored rather than refused
# (tool schemas are written for models that are only asked to follow them).
ARGUMENTS_JSON_OPTIONS = {**JSON_OPTIONS, "lenient": True}
TEMPLATE_USES_TOOLS = re.compile(r"\btools\b")

TOOLS_SECTION = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


# ---- which tools apply ---------------------------------------------------------


def offered_tools(body: ChatCompletionRequest) -> list[ToolDefinition] | None:
    """The tools the prompt lists and the reply is parsed for; None when there are none or tool_choice is "none"."""
    if not body.tools or body.tool_choice == "none":
        return None
    return body.tools


# ---- rendering -----------------------------------------------------------------


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template has a `tools` variable (then it knows its own tool format)."""
    template = getattr(tokenizer, "chat_template", None)
    sources = template.values() if isinstance(template, dict) else [template or ""]
    return any(TEMPLATE_USES_TOOLS.search(source) for source in sources)


def conversation_with_tools(
    tokenizer: Any, conversation: list[dict[str, Any]], tools: list[ToolDefinition] | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The conversation (transformers message dicts) and extra apply_chat_template arguments that render `tools`.

    Messages with `tool_calls` or the "tool" role are rewritten into plain ones when
    the template cannot render them, so a history of calls works with any template.
    """
    if not tools and not any(_is_tool_related(message) for message in conversation):
        return conversation, {}
    if template_renders_tools(tokenizer):
        template_kwargs = {"tools": [tool_json(tool) for tool in tools]} if tools else {}
        return [_with_argument_objects(message) for message in conversation], template_kwargs
    return hermes_conversation(conversation, tools), {}


def _is_tool_related(message: dict[str, Any]) -> bool:
    return message["role"] == "tool" or bool(message.get("tool_calls"))


def tool_json(tool: ToolDefinition) -> dict[str, Any]:
    """The tool as OpenAI JSON, as the model sees it listed."""
    return {"type": "function", "function": tool.function.model_dump(exclude_none=True, exclude={"strict"})}


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    """transformers templates expect each call's arguments as an object (they `tojson` it), not JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = [_call_with_argument_object(call) for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _call_with_argument_object(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except (TypeError, ValueError):
        return call  # not JSON: the template shows the text
    return {**call, "function": {**function, "arguments": arguments}}


def hermes_conversation(
    conversation: list[dict[str, Any]], tools: list[ToolDefinition] | None
) -> list[dict[str, Any]]:
    """Plain system/user/assistant messages that carry tools, calls and results in the Hermes format."""
    rendered: list[dict[str, Any]] = []
    previous_role = None
    for message in conversation:
        if message["role"] == "tool" and previous_role == "tool":  # results of one turn's calls share a user turn
            rendered[-1]["content"] += "\n" + _tool_response_text(message["content"])
        elif message["role"] == "tool":
            rendered.append({"role": "user", "content": _tool_response_text(message["content"])})
        elif message.get("tool_calls"):
            rendered.append({"role": message["role"], "content": _assistant_text(message)})
        else:
            rendered.append({"role": message["role"], "content": message["content"]})
        previous_role = message["role"]
    return _with_tools_section(rendered, tools) if tools else rendered


def _tool_response_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def _assistant_text(message: dict[str, Any]) -> str:
    calls = [tool_call_text(call["function"]["name"], call["function"]["arguments"]) for call in message["tool_calls"]]
    return "\n".join(([message["content"]] if message["content"] else []) + calls)


def tool_call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (and as the grammar forces it): arguments verbatim, normally JSON."""
    return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{TOOL_CALL_CLOSE}'


def _with_tools_section(rendered: list[dict[str, Any]], tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    """The tools section appended to the system message, or as a new first system message."""
    listing = "\n".join(json.dumps(tool_json(tool), ensure_ascii=False) for tool in tools)
    section = TOOLS_SECTION.format(tools=listing)
    if rendered and rendered[0]["role"] == "system":
        first = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{section}"}
        return [first, *rendered[1:]]
    return [{"role": "system", "content": section}, *rendered]


# ---- parsing -------------------------------------------------------------------


@dataclass
class ParsedText:
    """What a piece of generated text releases: content to show, and the calls completed in it."""

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser:
    """Splits a reply, as its text streams in, into content and `<tool_call>` blocks.

    Text that may be the start of `<tool_call>` is held back until it is decided, and
    an open block until it closes. Trailing whitespace of the content is held too and
    dropped if the reply turns out to call tools, so that the streamed content equals
    the content of the whole parsed reply (parse_tool_calls). A block whose JSON is not
    a call stays content, verbatim.
    """

    def __init__(self) -> None:
        self._buffer = ""  # undecided text: a possible tag start, or an open block's body
        self._in_block = False
        self._held_whitespace = ""  # trailing whitespace of the released content
        self.num_calls = 0

    def feed(self, text: str) -> ParsedText:
        self._buffer += text
        parsed = ParsedText()
        while self._advance(parsed):
            pass
        if not self._in_block:
            num_held = _num_chars_that_may_start(self._buffer, TOOL_CALL_OPEN)
            self._release(parsed, self._buffer[:len(self._buffer) - num_held])
            self._buffer = self._buffer[len(self._buffer) - num_held:]
        return parsed

    def finish(self) -> ParsedText:
        """The rest of the reply: an unclosed last block counts as a call if its JSON is complete."""
        parsed = ParsedText()
        if self._in_block:
            self._take_block(parsed, self._buffer, TOOL_CALL_OPEN + self._buffer)
        else:
            self._release(parsed, self._buffer)
        self._buffer, self._in_block = "", False
        if self.num_calls == 0:
            parsed.content += self._held_whitespace
        self._held_whitespace = ""
        return parsed

    def _advance(self, parsed: ParsedText) -> bool:
        """Handle the next complete tag in the buffer; False when there is none."""
        tag = TOOL_CALL_CLOSE if self._in_block else TOOL_CALL_OPEN
        position = self._buffer.find(tag)
        if position < 0:
            return False
        before, self._buffer = self._buffer[:position], self._buffer[position + len(tag):]
        if self._in_block:
            self._take_block(parsed, before, TOOL_CALL_OPEN + before + TOOL_CALL_CLOSE)
        else:
            self._release(parsed, before)
        self._in_block = not self._in_block
        return True

    def _take_block(self, parsed: ParsedText, body: str, verbatim: str) -> None:
        call = tool_call_of_block(body)
        if call is None:
            self._release(parsed, verbatim)
        else:
            parsed.tool_calls.append(call)
            self.num_calls += 1

    def _release(self, parsed: ParsedText, text: str) -> None:
        text = self._held_whitespace + text
        num_kept = len(text.rstrip())
        parsed.content += text[:num_kept]
        self._held_whitespace = text[num_kept:]


def _num_chars_that_may_start(text: str, tag: str) -> int:
    """How many of the last characters of `text` are a proper prefix of `tag`."""
    for num_chars in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:num_chars]):
            return num_chars
    return 0


def tool_call_of_block(body: str) -> ToolCall | None:
    """The call in a `<tool_call>` block's body ({"name": ..., "arguments": {...}}), or None if it is not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
    return ToolCall(id=new_tool_call_id(), function=FunctionCall(name=call["name"], arguments=arguments))


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None if it only calls tools) and tool calls."""
    parser = ToolCallParser()
    head, tail = parser.feed(text), parser.finish()
    content = head.content + tail.content
    calls = head.tool_calls + tail.tool_calls
    return (None if calls and not content.strip() else content), calls


# ---- replies -------------------------------------------------------------------


def tool_call_reply(text: str, finish_reason: str) -> tuple[AssistantMessage, str]:
    """The assistant message of a whole reply parsed for tool calls, and the choice's finish reason."""
    content, calls = parse_tool_calls(text)
    message = AssistantMessage(content=content, tool_calls=calls or None)
    return message, finish_reason_with_calls(finish_reason, bool(calls))


def finish_reason_with_calls(finish_reason: str, called: bool) -> str:
    """ "tool_calls" for a reply that ended by itself after calling tools; a reply cut short stays "length"."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


class ToolCallStreams:
    """The streaming parsers of a request's choices (by index), releasing OpenAI stream deltas.

    Each complete call goes out whole in one delta, when its closing tag arrives.
    """

    def __init__(self) -> None:
        self._parsers: dict[int, ToolCallParser] = {}

    def delta(self, index: int, text: str) -> DeltaMessage | None:
        """What TEXT releases for choice INDEX; None when all of it is held back."""
        parser = self._parser(index)
        return _delta_message(parser, parser.feed(text))

    def final_delta(self, index: int) -> DeltaMessage | None:
        """What choice INDEX still held when it ended."""
        parser = self._parser(index)
        return _delta_message(parser, parser.finish())

    def finish_reason(self, index: int, finish_reason: str) -> str:
        """Call after final_delta (which may complete a last call)."""
        return finish_reason_with_calls(finish_reason, self._parser(index).num_calls > 0)

    def _parser(self, index: int) -> ToolCallParser:
        return self._parsers.setdefault(index, ToolCallParser())


def _delta_message(parser: ToolCallParser, parsed: ParsedText) -> DeltaMessage | None:
    if not parsed.content and not parsed.tool_calls:
        return None
    first_index = parser.num_calls - len(parsed.tool_calls)  # calls are numbered across the whole choice
    calls = [
        DeltaToolCall(
            index=first_index + offset,
            id=call.id,
            type="function",
            function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
        )
        for offset, call in enumerate(parsed.tool_calls)
    ]
    return DeltaMessage(content=parsed.content or None, tool_calls=calls or None)


# ---- enforcement ---------------------------------------------------------------


def tool_grammar(
    tools: list[ToolDefinition] | None,
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool | None,
) -> str | None:
    """The llguidance grammar that forces tool calls, for tool_choice "required" or a named function; else None.

    400 when tool_choice names no offered function, or a parameters schema cannot be compiled.
    """
    if tool_choice in (None, "auto", "none"):
        return None
    functions = _forced_functions(tools or [], tool_choice)
    grammar = LLMatcher.grammar_from_lark(tool_calls_lark(functions, many=parallel_tool_calls is not False))
    check_grammar(grammar, "tools")
    return grammar


def _forced_functions(tools: list[ToolDefinition], tool_choice: str | NamedToolChoice) -> list[ToolDefinition]:
    if not tools:
        raise APIError(400, "tool_choice requires tools: the request offers none", param="tool_choice")
    if not isinstance(tool_choice, NamedToolChoice):
        return tools  # "required": any of them
    named = [tool for tool in tools if tool.function.name == tool_choice.function.name]
    if not named:
        offered = ", ".join(tool.function.name for tool in tools)
        message = f"tool_choice names the function `{tool_choice.function.name}`, which is not in tools ({offered})"
        raise APIError(400, message, param="tool_choice")
    return named


def tool_calls_lark(functions: list[ToolDefinition], many: bool) -> str:
    """A Lark grammar of one (or, with `many`, one or more) `<tool_call>` blocks calling `functions`."""
    repeat = ' ("\\n" tool_call)*' if many else ""
    alternatives = " | ".join(f"function_{i}" for i in range(len(functions)))
    rules = [
        f"start: tool_call{repeat}",
        f"tool_call: {json.dumps(TOOL_CALL_OPEN + chr(10))} function_call {json.dumps(chr(10) + TOOL_CALL_CLOSE)}",
        f"function_call: {alternatives}",
    ]
    rules += [f"function_{i}: {_function_call_rule(tool)}" for i, tool in enumerate(functions)]
    return "\n".join(rules) + "\n"


def _function_call_rule(tool: ToolDefinition) -> str:
    """`{"name": "<name>", "arguments": <JSON following the parameters schema>}`, its schema inline (`%json`)."""
    head = f'{{"name": {json.dumps(tool.function.name)}, "arguments": '
    return f"{json.dumps(head)} %json {json.dumps(arguments_schema(tool))} {json.dumps('}')}"


def arguments_schema(tool: ToolDefinition) -> dict[str, Any]:
    """The function's parameters schema with our JSON formatting options (`x-guidance`, in place of any given)."""
    schema = tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS_SCHEMA
    return {**schema, "x-guidance": ARGUMENTS_JSON_OPTIONS}
