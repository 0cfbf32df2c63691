"""`response_format` as a grammar the engine enforces at every position (engine/grammar.py), checked before it goes.

JSON is generated compactly (no free whitespace: `, ` and `: ` separators only), so
a small model cannot wander into endless blank lines inside an object and a
max_tokens budget goes to content. `json_object` is any JSON object; `json_schema`
follows the schema (additional properties as the schema says, JSON Schema's default
being allowed). A schema, regular expression or grammar llguidance cannot compile
is a 400 that gives its reason.
"""
from __future__ import annotations

from typing import Any

from llguidance import LLMatcher

from server.errors import APIError
from server.protocol import ResponseFormat

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PARAM = "response_format"


def response_format_grammar(response_format: ResponseFormat | None) -> str | None:
    """The llguidance grammar of a response format; None for text (or none given)."""
    if response_format is None or response_format.type == "text":
        return None
    try:
        grammar = _grammar_of(response_format)
    except ValueError as exc:  # llguidance refuses some schemas before compiling them
        raise APIError(400, f"{PARAM} cannot be enforced: {exc}", param=PARAM) from exc
    check_grammar(grammar, PARAM)
    return grammar


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    return LLMatcher.grammar_from_json_schema({} if schema is True else schema, overrides=JSON_OPTIONS)


def check_grammar(grammar: str, param: str) -> None:
    """400 naming PARAM when llguidance cannot compile the grammar."""
    reason = LLMatcher.validate_grammar(grammar)
    if reason:
        raise APIError(400, f"{param} cannot be enforced: {reason.strip()}", param=param)


def _grammar_of(response_format: ResponseFormat) -> str:
    if response_format.type == "json_object":
        return json_schema_grammar({"type": "object"})
    if response_format.type == "json_schema":
        schema = response_format.json_schema.schema_
        if schema is False:
            raise APIError(400, "a json_schema of false accepts nothing", param=PARAM)
        return json_schema_grammar(schema)
    if response_format.type == "regex":
        return LLMatcher.grammar_from_regex(response_format.regex)
    return LLMatcher.grammar_from_lark(response_format.grammar)
