"""One request's engine outputs turned into text: detokenized, cut at stop strings, counted."""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from engine.wire import RequestOutput, SpecStats, TokenLogprob
from server.detokenizer import IncrementalDetokenizer, StopChecker
from server.errors import SERVER_ERROR, APIError, engine_unavailable

FINISHED_OK = ("stop", "length")


@dataclass
class Delta:
    """New text of a choice, with the log-probabilities of the tokens that arrived with it (when asked)."""

    text: str
    logprobs: list[TokenLogprob] | None = None


class Generation:
    """Text deltas of one engine request, plus its finish reason, token count and spec stats.

    `first` is the request's first output, already awaited by the caller (so that
    admission errors surface before a response starts); `outputs` yields the rest.
    Stopping early (a stop string) leaves `outputs` unconsumed: `aclose()` closes it,
    which aborts the request in the engine. With SCORES_PROMPT_ONLY the request is there
    for its prompt log-probabilities: its generated tokens are left out.
    """

    def __init__(
        self,
        first: RequestOutput,
        outputs: AsyncIterator[RequestOutput],
        tokenizer: Any,
        stop: Sequence[str] | None,
        scores_prompt_only: bool = False,
    ) -> None:
        self._first: RequestOutput | None = first
        self._outputs = outputs
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop_checker = StopChecker(stop)
        self.finish_reason: str | None = None  # "stop" | "length" once finished
        self.num_completion_tokens = 0  # generated tokens received from the engine
        self.spec: SpecStats | None = None  # the latest stats the engine sent
        self.num_cached_tokens = first.num_cached_tokens  # prompt tokens whose KV a session cache supplied
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # when the request asked, once computed
        self._scores_prompt_only = scores_prompt_only

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas with text or log-probabilities until the request finishes or hits a stop string."""
        while self.finish_reason is None:
            output = await self._next_output()
            text = self._on_output(output)
            logprobs = None if self._scores_prompt_only else output.logprobs
            if text or logprobs:
                yield Delta(text, logprobs)

    async def collect(self) -> Delta:
        """The whole text, and every token's log-probabilities when asked."""
        text, logprobs = [], None
        async for delta in self.deltas():
            text.append(delta.text)
            if delta.logprobs is not None:
                logprobs = (logprobs or []) + delta.logprobs
        return Delta("".join(text), logprobs)

    async def aclose(self) -> None:
        """Close the engine outputs (aborting the request if it still runs); safe to repeat."""
        await close_outputs(self._outputs)

    async def _next_output(self) -> RequestOutput:
        if self._first is not None:
            output, self._first = self._first, None
            return output
        output = await anext(self._outputs, None)
        if output is None:
            raise APIError(500, "the engine ended the request without a finish reason", SERVER_ERROR)
        return output

    def _on_output(self, output: RequestOutput) -> str:
        self.spec = output.spec or self.spec
        self.num_cached_tokens = output.num_cached_tokens
        self.prompt_logprobs = output.prompt_logprobs or self.prompt_logprobs
        finished = output.finish_reason is not None
        if finished:
            _raise_if_failed(output)
        if self._scores_prompt_only:
            if finished:
                self.finish_reason = "length"
            return ""
        self.num_completion_tokens += len(output.new_token_ids)
        text = self._detokenizer.add(output.new_token_ids)
        if finished:
            text += self._detokenizer.flush()
        text, hit_stop = self._stop_checker.push(text)
        if hit_stop:
            self.finish_reason = "stop"
        elif finished:
            self.finish_reason = output.finish_reason
            text += self._stop_checker.flush()
        return text


async def close_outputs(outputs: AsyncIterator[RequestOutput]) -> None:
    """Close an engine output stream, shielded from the caller's cancellation."""
    close = getattr(outputs, "aclose", None)
    if close is not None:
        with anyio.CancelScope(shield=True):
            await close()


def _raise_if_failed(output: RequestOutput) -> None:
    if output.finish_reason in FINISHED_OK:
        return
    if output.finish_reason == "abort":
        raise engine_unavailable("the engine aborted the request")
    raise APIError(500, f"the engine failed the request: {output.error or output.finish_reason}", SERVER_ERROR)
