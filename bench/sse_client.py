"""One streamed chat completion, completion of a text, or Responses API turn, against an OpenAI-compatible server,
timed on the client."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx


@dataclass
class StreamedReply:
    text: str
    ttft_s: float  # request sent to first text chunk
    e2e_s: float  # request sent to end of stream
    decode_s: float  # first text chunk to last text chunk
    num_text_chunks: int
    usage: dict | None  # the usage chunk (stream_options.include_usage), if the server sent one
    spec_stats: dict | None  # specserve's extension on the final chunks, if the server sent it
    response_id: str | None = None  # a Responses API reply's id (what previous_response_id names)

    @property
    def completion_tokens(self) -> int:
        """Usage's count; for a server that sends no usage, one token per text chunk."""
        return (self.usage or {}).get("completion_tokens") or self.num_text_chunks

    @property
    def prompt_tokens(self) -> int:
        return (self.usage or {}).get("prompt_tokens") or 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from a cache; 0 where the server does not say."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens") or 0


def chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    """A greedy streamed chat request that asks for the usage chunk."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}


def completion_body(model: str, prompt: str, max_tokens: int) -> dict:
    """A greedy streamed completion of PROMPT (no chat template: a base model's use) that asks for the usage chunk."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str] | None = None
) -> StreamedReply:
    """POST BODY to URL/chat/completions (URL/completions for a body with a prompt) and read the SSE stream to its
    end."""
    start = time.perf_counter()
    first = last = None
    pieces: list[str] = []
    usage = spec_stats = None
    endpoint = "/completions" if "prompt" in body else "/chat/completions"
    async with client.stream("POST", url + endpoint, json=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"{url} reported an error mid-stream: {chunk['error']}")
            usage = chunk.get("usage") or usage
            spec_stats = chunk.get("spec_stats") or spec_stats
            text = "".join(choice.get("delta", {}).get("content") or choice.get("text") or ""
                           for choice in chunk.get("choices", []))
            if text:
                last = time.perf_counter()
                first = first or last
                pieces.append(text)
    if first is None:
        raise RuntimeError("the server streamed no text")
    return StreamedReply("".join(pieces), first - start, time.perf_counter() - start, last - first, len(pieces), usage,
                         spec_stats)


def response_body(model: str, user_text: str, previous_response_id: str | None, max_tokens: int) -> dict:
    """A greedy streamed Responses API turn continuing PREVIOUS_RESPONSE_ID (None: the first turn)."""
    return {"model": model, "input": user_text, "previous_response_id": previous_response_id,
            "max_output_tokens": max_tokens, "temperature": 0.0, "stream": True}


async def stream_response(client: httpx.AsyncClient, url: str, body: dict) -> StreamedReply:
    """POST BODY to URL/responses and read its events to the end; usage as the chat endpoint names it."""
    start = time.perf_counter()
    first = last = None
    pieces: list[str] = []
    final = None
    async with client.stream("POST", url + "/responses", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            if event["type"] == "error":
                raise RuntimeError(f"{url} reported an error mid-stream: {event}")
            if event["type"] == "response.output_text.delta":
                last = time.perf_counter()
                first = first or last
                pieces.append(event["delta"])
            elif event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
    if first is None or final is None:
        raise RuntimeError("the server streamed no text or no final response")
    usage = final["usage"]
    chat_usage = {"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"],
                  "prompt_tokens_details": usage["input_tokens_details"]}
    return StreamedReply("".join(pieces), first - start, time.perf_counter() - start, last - first, len(pieces),
                         chat_usage, None, final["id"])
