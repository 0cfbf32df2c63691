"""Generation and the SSE event sequence, fed hand-made engine outputs (no engine, no HTTP)."""
from __future__ import annotations

import asyncio
import json

import openai.types as openai_types
import openai.types.chat as openai_chat
import pytest

from engine.wire import RequestOutput, SpecStats
from server.chat import ChatFormatter
from server.completions import CompletionFormatter
from server.errors import APIError
from server.generation import Generation
from server.serving import spec_stats_info, stream_events, usage_of

SPEC = SpecStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6)


class OutputSource:
    """An async generator of given outputs that records whether it was closed early."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs
        self.num_consumed = 0
        self.closed_early = False

    async def stream(self):
        try:
            for output in self.outputs:
                self.num_consumed += 1
                yield output
        except GeneratorExit:
            self.closed_early = True
            raise


CACHED = 4  # prompt tokens the engine says came from a session cache


def outputs_of(token_chunks: list[list[int]], finish_reason: str = "length", **last) -> list[RequestOutput]:
    outputs = [RequestOutput("r", ids, num_cached_tokens=CACHED) for ids in token_chunks]
    outputs[-1].finish_reason = finish_reason
    outputs[-1].spec = SPEC
    for name, value in last.items():
        setattr(outputs[-1], name, value)
    return outputs


def chunked(token_ids: list[int], size: int) -> list[list[int]]:
    return [token_ids[i : i + size] for i in range(0, len(token_ids), size)]


async def start(source: OutputSource, tokenizer, stop=None) -> Generation:
    """As serving does: await the first output, then hand both to Generation."""
    stream = source.stream()
    return Generation(await anext(stream), stream, tokenizer, stop)


def run_text(source: OutputSource, tokenizer, stop=None) -> tuple[str, Generation]:
    async def run():
        generation = await start(source, tokenizer, stop)
        try:
            return await generation.text(), generation
        finally:
            await generation.aclose()

    return asyncio.run(run())


def test_text_and_counts_until_length(tokenizer):
    token_ids = tokenizer.encode("héllo wörld 你好 🙂", add_special_tokens=False)
    text, generation = run_text(OutputSource(outputs_of(chunked(token_ids, 2))), tokenizer)
    assert text == "héllo wörld 你好 🙂"
    assert generation.finish_reason == "length"
    assert generation.num_completion_tokens == len(token_ids)
    assert spec_stats_info(generation.spec).mean_acceptance_length == 1.0 + 6 / 4


def test_eos_is_counted_but_not_shown(tokenizer):
    token_ids = tokenizer.encode("done", add_special_tokens=False) + [2]
    text, generation = run_text(OutputSource(outputs_of([token_ids], "stop")), tokenizer)
    assert text == "done"
    assert (generation.finish_reason, generation.num_completion_tokens) == ("stop", len(token_ids))


def test_stop_string_ends_early_and_closes_the_engine_stream(tokenizer):
    token_ids = tokenizer.encode("one two three four five six", add_special_tokens=False)
    source = OutputSource(outputs_of(chunked(token_ids, 1)))
    text, generation = run_text(source, tokenizer, stop=[" three"])
    assert text == "one two"
    assert generation.finish_reason == "stop"
    assert source.closed_early
    assert source.num_consumed < len(source.outputs)


@pytest.mark.parametrize("finish_reason, status", [("error", 500), ("abort", 503)])
def test_failed_request_raises(tokenizer, finish_reason, status):
    source = OutputSource(outputs_of([[88], [89]], finish_reason, error="boom"))
    with pytest.raises(APIError) as info:
        run_text(source, tokenizer)
    assert info.value.status_code == status


def collect_events(source: OutputSource, tokenizer, formatter, include_usage: bool) -> list:
    async def run():
        generation = await start(source, tokenizer)
        try:
            return [event async for event in stream_events(generation, formatter, 10, include_usage)]
        finally:
            await generation.aclose()

    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def test_chat_stream_events_follow_openai(tokenizer):
    token_ids = tokenizer.encode("Hi there 🙂", add_special_tokens=False)
    source = OutputSource(outputs_of(chunked(token_ids, 1), "stop"))
    chunks = collect_events(source, tokenizer, ChatFormatter("chatcmpl-x", "m"), include_usage=True)
    parsed = [openai_chat.ChatCompletionChunk.model_validate(c) for c in chunks]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(p.choices[0].delta.content or "" for p in parsed[:-1]) == "Hi there 🙂"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "stop"
    assert chunks[-2]["spec_stats"] == {
        "drafted_tokens": 12, "accepted_tokens": 6, "num_drafts": 4, "mean_acceptance_length": 2.5
    }
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 10, "completion_tokens": len(token_ids), "total_tokens": 10 + len(token_ids),
        "prompt_tokens_details": {"cached_tokens": CACHED},
    }
    assert {c["id"] for c in chunks} == {"chatcmpl-x"}


def test_completion_stream_events_without_usage(tokenizer):
    token_ids = tokenizer.encode("abc def", add_special_tokens=False)
    source = OutputSource(outputs_of(chunked(token_ids, 1)))
    chunks = collect_events(source, tokenizer, CompletionFormatter("cmpl-x", "m"), include_usage=False)
    openai_types.Completion.model_validate(chunks[-1])
    assert [c["object"] for c in chunks] == ["text_completion"] * len(chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc def"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] is None and chunks[-1]["spec_stats"]["num_drafts"] == 4


def test_stream_reports_an_engine_failure_in_band(tokenizer):
    source = OutputSource(outputs_of([[88], [89]], "error", error="device lost"))
    chunks = collect_events(source, tokenizer, ChatFormatter("chatcmpl-x", "m"), include_usage=True)
    assert chunks[-1]["error"]["type"] == "server_error"
    assert "device lost" in chunks[-1]["error"]["message"]


def test_non_streaming_objects_parse_with_the_openai_client_types():
    spec = spec_stats_info(SPEC)
    usage = usage_of(3, type("G", (), {"num_completion_tokens": 2, "num_cached_tokens": 1})())
    chat = ChatFormatter("chatcmpl-x", "m").response("hello", "stop", usage, spec).model_dump(mode="json")
    parsed = openai_chat.ChatCompletion.model_validate(chat)
    assert parsed.choices[0].message.content == "hello" and parsed.usage.total_tokens == 5
    assert parsed.usage.prompt_tokens_details.cached_tokens == 1
    assert chat["object"] == "chat.completion" and chat["spec_stats"]["accepted_tokens"] == 6
    text = CompletionFormatter("cmpl-x", "m").response("hello", "length", usage, spec).model_dump(mode="json")
    assert openai_types.Completion.model_validate(text).choices[0].text == "hello"
    assert text["object"] == "text_completion" and text["spec_stats"]["drafted_tokens"] == 12
