"""Generation and the SSE event sequence, fed hand-made engine outputs (no engine, no HTTP)."""
from __future__ import annotations

import asyncio
import json

import openai.types as openai_types
import openai.types.chat as openai_chat
import pytest

from engine.wire import RequestOutput, SpecStats, TokenLogprob
from server.chat import ChatFormatter
from server.choices import FinishedChoice
from server.completions import CompletionFormatter
from server.errors import APIError
from server.generation import Generation
from server.logprobs import LogprobFormatter
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
            return (await generation.collect()).text, generation
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


def chat_formatter(tokenizer) -> ChatFormatter:
    return ChatFormatter("chatcmpl-x", "m", LogprobFormatter(tokenizer))


def completion_formatter(tokenizer) -> CompletionFormatter:
    return CompletionFormatter("cmpl-x", "m", LogprobFormatter(tokenizer))


def collect_events(sources: OutputSource | list[OutputSource], tokenizer, formatter, include_usage: bool) -> list:
    sources = sources if isinstance(sources, list) else [sources]

    async def run():
        generations = [await start(source, tokenizer) for source in sources]
        try:
            return [event async for event in stream_events(generations, formatter, 10, include_usage)]
        finally:
            for generation in generations:
                await generation.aclose()

    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def test_chat_stream_events_follow_openai(tokenizer):
    token_ids = tokenizer.encode("Hi there 🙂", add_special_tokens=False)
    source = OutputSource(outputs_of(chunked(token_ids, 1), "stop"))
    chunks = collect_events(source, tokenizer, chat_formatter(tokenizer), include_usage=True)
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
    chunks = collect_events(source, tokenizer, completion_formatter(tokenizer), include_usage=False)
    openai_types.Completion.model_validate(chunks[-1])
    assert [c["object"] for c in chunks] == ["text_completion"] * len(chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc def"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] is None and chunks[-1]["spec_stats"]["num_drafts"] == 4


def test_stream_reports_an_engine_failure_in_band(tokenizer):
    source = OutputSource(outputs_of([[88], [89]], "error", error="device lost"))
    chunks = collect_events(source, tokenizer, chat_formatter(tokenizer), include_usage=True)
    assert chunks[-1]["error"]["type"] == "server_error"
    assert "device lost" in chunks[-1]["error"]["message"]


def test_non_streaming_objects_parse_with_the_openai_client_types(tokenizer):
    spec = spec_stats_info(SPEC)
    usage = usage_of(3, [type("G", (), {"num_completion_tokens": 2, "num_cached_tokens": 1})()])
    chat = chat_formatter(tokenizer).response([FinishedChoice(0, "hello", "stop")], usage, spec).model_dump(mode="json")
    parsed = openai_chat.ChatCompletion.model_validate(chat)
    assert parsed.choices[0].message.content == "hello" and parsed.usage.total_tokens == 5
    assert parsed.usage.prompt_tokens_details.cached_tokens == 1
    assert chat["object"] == "chat.completion" and chat["spec_stats"]["accepted_tokens"] == 6
    text = completion_formatter(tokenizer).response([FinishedChoice(0, "hello", "length")], usage, spec)
    text = text.model_dump(mode="json")
    assert openai_types.Completion.model_validate(text).choices[0].text == "hello"
    assert text["object"] == "text_completion" and text["spec_stats"]["drafted_tokens"] == 12


def logprobs_of(token_ids: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(t, -0.5 * i, [t, 13], [-0.5 * i, -3.0]) for i, t in enumerate(token_ids)]


def test_streamed_logprobs_follow_their_tokens_in_both_shapes(tokenizer):
    token_ids = tokenizer.encode("Hi 🙂 there", add_special_tokens=False)
    entries = logprobs_of(token_ids)
    outputs = [RequestOutput("r", [t], logprobs=[entry]) for t, entry in zip(token_ids, entries)]
    outputs[-1].finish_reason = "length"
    chat_chunks = collect_events(OutputSource(outputs), tokenizer, chat_formatter(tokenizer), include_usage=False)
    parsed = [openai_chat.ChatCompletionChunk.model_validate(c) for c in chat_chunks]
    entries = [e for p in parsed if p.choices[0].logprobs for e in p.choices[0].logprobs.content]
    assert len(entries) == len(token_ids)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == "Hi 🙂 there"  # the emoji's bytes span two tokens
    assert [e.top_logprobs[1].token for e in entries] == [tokenizer.decode([13])] * len(token_ids)
    completion_chunks = collect_events(OutputSource(outputs), tokenizer, completion_formatter(tokenizer), False)
    shaped = [c["choices"][0]["logprobs"] for c in completion_chunks if c["choices"][0]["logprobs"]]
    assert [s["token_logprobs"][0] for s in shaped] == [-0.5 * i for i in range(len(token_ids))]
    assert [s["text_offset"][0] for s in shaped] == sorted(s["text_offset"][0] for s in shaped)


def test_choices_stream_interleaved_by_index_and_usage_counts_them_all(tokenizer):
    sources = [OutputSource(outputs_of(chunked(tokenizer.encode(text, add_special_tokens=False), 1), "stop"))
               for text in ("one two three", "four five")]
    chunks = collect_events(sources, tokenizer, chat_formatter(tokenizer), include_usage=True)
    by_index = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            by_index[choice["index"]] += choice["delta"].get("content") or ""
    assert by_index == {0: "one two three", 1: "four five"}
    assert sorted(c["choices"][0]["index"] for c in chunks
                  if c["choices"] and c["choices"][0]["finish_reason"]) == [0, 1]
    num_tokens = sum(len(s.outputs) for s in sources)
    assert chunks[-1]["usage"]["completion_tokens"] == num_tokens and chunks[-1]["usage"]["prompt_tokens"] == 10
    assert chunks[-1]["spec_stats"]["num_drafts"] == 2 * SPEC.num_drafts
