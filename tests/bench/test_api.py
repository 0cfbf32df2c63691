"""The API-feature benchmark: request variants, output checks, the interleaved requests, rows, mismatches and files."""
from __future__ import annotations

import json

import httpx
import pytest

from bench.api import (
    ANSWER_SCHEMA,
    logit_bias,
    matches_answer_schema,
    measure_question,
    output_text,
    request_variants,
    tool_call_parses,
    warm_up_variants,
)
from bench.api_report import mismatches, summary_rows, write_api_results
from bench.cli import API_VARIANTS
from specserve import build_parser

QUESTION = {"question_id": 81, "category": "writing", "turns": ["first", "second"]}


class WordTokenizer:
    """Each listed text is one token; anything else is two."""

    IDS = {" the": 10, " and": 11, ".": 12, " a": 13}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.IDS[text]] if text in self.IDS else [1, 2]


def completion(content: str | None, tool_calls: list | None = None, finish_reason: str = "stop") -> dict:
    message = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
    return {"choices": [{"message": message, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
            "spec_stats": {"drafted_tokens": 3, "accepted_tokens": 2, "num_drafts": 1}}


def call(arguments: str, name: str = "answer") -> dict:
    return {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}


def record(variant: str, drafter: str, question_id: int, text: str, seconds: float, valid: bool | None = None) -> dict:
    return {"question_id": question_id, "category": "writing", "variant": variant, "drafter": drafter,
            "measured_at_s": 0.0, "seconds": seconds, "completion_tokens": 10, "finish_reason": "stop",
            "drafted_tokens": 4, "accepted_tokens": 2 if drafter == "copyspec" else 0,
            "num_drafts": 1 if drafter == "copyspec" else 0, "valid": valid, "text": text}


def test_logit_bias_raises_three_tokens_and_bans_one():
    assert logit_bias(WordTokenizer()) == {"10": 2.0, "11": 2.0, "12": 2.0, "13": -100.0}
    variants = request_variants(WordTokenizer(), ("tool_call", "plain", "logit_bias"))
    assert list(variants) == ["tool_call", "plain", "logit_bias"] and variants["plain"] == {}
    assert variants["tool_call"]["tool_choice"] == {"type": "function", "function": {"name": "answer"}}

    class SplitTokenizer(WordTokenizer):
        IDS = {" and": 11, ".": 12, " a": 13}

    with pytest.raises(ValueError, match="' the' is 2 tokens"):
        logit_bias(SplitTokenizer())


def test_structured_outputs_are_checked_and_tool_calls_compared_with_their_arguments():
    assert (matches_answer_schema('{"answer": "x", "confidence": 50}')
            and not matches_answer_schema('{"answer": "x", "confidence": 0.5}'))
    assert (not matches_answer_schema('{"answer": "x"}')
            and not matches_answer_schema('{"answer": "x", "confidence": "high"}'))
    assert not matches_answer_schema('{"answer": "x", "confid') and not matches_answer_schema(None)
    assert ANSWER_SCHEMA["required"] == ["answer", "confidence"]
    assert tool_call_parses({"tool_calls": [call('{"text": "hi"}')]})
    assert not tool_call_parses({"tool_calls": [call('{"text": 3}')]}) and not tool_call_parses({"content": "hi"})
    assert not tool_call_parses({"tool_calls": [call('{"text": "hi"}', name="other")]})
    assert output_text({"content": None, "tool_calls": [call('{"text": "hi"}')]}) == '\n[tool answer] {"text": "hi"}'


def test_turn_one_is_asked_of_none_then_every_variant_on_both_servers_back_to_back_in_alternating_order():
    """Servers by host: `n` (none) and `c` (copyspec) answer with their host; turn 1 answers "answer one"."""
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        text = "answer one" if len(body["messages"]) == 1 else "same"
        tool_calls = [call('{"text": "t"}')] if "tools" in body else None
        return httpx.Response(200, json=completion(None if tool_calls else text, tool_calls))

    variants = request_variants(WordTokenizer(), ("plain", "penalties", "tool_call"))
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        records = measure_question(client, {"none": "http://n/v1", "copyspec": "http://c/v1"}, "m", QUESTION, variants,
                                   16, first_pair=1, clock_start=0.0)
    assert [host for host, _ in seen] == ["n", "c", "n", "n", "c", "c", "n"]
    turn2 = [body for _, body in seen[1:]]
    assert all([m["content"] for m in body["messages"]] == ["first", "answer one", "second"] for body in turn2)
    assert all(body["temperature"] == 0 and body["max_tokens"] == 16 and not body["stream"] for _, body in seen)
    assert seen[0][1]["messages"] == [{"role": "user", "content": "first"}] and "presence_penalty" not in seen[0][1]
    assert turn2[2]["presence_penalty"] == 0.5 and turn2[4]["tool_choice"]["function"]["name"] == "answer"
    assert [(r["variant"], r["drafter"]) for r in records] == [
        (v, d) for v in ("plain", "penalties", "tool_call") for d in ("none", "copyspec")]
    assert [r["valid"] for r in records] == [None] * 4 + [True, True]
    assert records[0]["completion_tokens"] == 4 and records[1]["num_drafts"] == 1 and records[1]["text"] == "same"


def test_a_rejected_variant_stops_the_run_with_the_servers_message():
    def answer(request: httpx.Request) -> httpx.Response:
        if "logprobs" in json.loads(request.content):
            return httpx.Response(400, json={"error": {"message": "logprobs are not supported"}})
        return httpx.Response(200, json=completion("hi"))

    variants = request_variants(WordTokenizer(), ("plain", "logprobs"))
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        with pytest.raises(RuntimeError, match="variant logprobs on --drafter none.*400.*logprobs are not supported"):
            warm_up_variants(client, {"none": "http://n/v1", "copyspec": "http://c/v1"}, "m", variants)


def test_rows_ratios_and_a_loud_mismatch(tmp_path):
    """Plain: copyspec twice as fast and identical; json_schema: half as fast, one output differs, one invalid."""
    records = [record("plain", "none", 1, "a", 2.0), record("plain", "copyspec", 1, "a", 1.0),
               record("plain", "none", 2, "b", 2.0), record("plain", "copyspec", 2, "b", 1.0),
               record("json_schema", "none", 1, "{}", 1.0, valid=False),
               record("json_schema", "copyspec", 1, "{x", 2.0, valid=True),
               record("json_schema", "none", 2, "b", 1.0, valid=True),
               record("json_schema", "copyspec", 2, "b", 2.0, valid=True)]
    plain, schema = summary_rows(records)
    speeds = ("none_tokens_per_s", "copyspec_tokens_per_s", "copyspec_over_none")
    assert [plain[key] for key in speeds] == [5.0, 10.0, 2.0] and [schema[key] for key in speeds] == [10.0, 5.0, 0.5]
    checks = ("identical", "mean_acceptance_length", "valid_none", "valid_copyspec", "none_equal_plain")
    assert ([plain[key] for key in checks] == [2, 3.0, None, None, None]
            and [schema[key] for key in checks] == [1, 3.0, 1, 2, 1])
    assert mismatches(records) == [{"variant": "json_schema", "question_id": 1, "first_difference_at_char": 1}]
    setup = {"num_conversations": 3, "max_new_tokens": 8, "specserve_flags": [], "variants": {}}
    results = write_api_results(records, "specserve bench api", setup, tmp_path)
    assert results["mismatches"] and json.loads((tmp_path / "results.json").read_text())["summary"][1]["identical"] == 1
    markdown = (tmp_path / "results.md").read_text()
    assert "Command: `specserve bench api`" in markdown and "Conversations: 2 of 3 (so far)" in markdown
    assert "| json_schema | 2 | 10.0 | 5.0 | 0.50 | 3.00 | 1/2 | 1/2 · 2/2 | 0 · 0 | 1/2 |" in markdown
    assert "**Slower with copyspec than without: json_schema (0.50×).**" in markdown
    assert "**LOSSLESS CHECK FAILED: 1 copyspec outputs differ" in markdown
    assert "- json_schema, question 1: first difference at character 1" in markdown


def test_cli_variants_default_to_all_and_reject_unknown_names():
    assert build_parser().parse_args(["bench", "api"]).variants == API_VARIANTS
    assert (build_parser().parse_args(["bench", "api", "--variants", "plain, logprobs,plain"]).variants
            == ("plain", "logprobs"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "api", "--variants", "beam_search"])
