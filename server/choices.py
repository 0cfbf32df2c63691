"""A request's `n` choices: each its own engine request, collected together or streamed interleaved by index."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.wire import SpecStats, TokenLogprob
from server.generation import Delta, Generation


@dataclass
class FinishedChoice:
    index: int
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None  # every token's, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # every prompt token's, when the request asked


async def collect_choices(generations: list[Generation]) -> list[FinishedChoice]:
    """Every choice to its end, concurrently (they run in the same engine batch)."""
    deltas = await asyncio.gather(*(generation.collect() for generation in generations))
    return [
        FinishedChoice(index, delta.text, generation.finish_reason, delta.logprobs, generation.prompt_logprobs)
        for index, (delta, generation) in enumerate(zip(deltas, generations))
    ]


async def interleaved_deltas(generations: list[Generation]) -> AsyncIterator[tuple[int, Delta | None]]:
    """(choice index, delta) in arrival order; (index, None) once when a choice ends."""
    streams = [generation.deltas() for generation in generations]
    pending = {_next(stream): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):  # same-step deltas in index order
                index = pending.pop(task)
                delta = task.result()
                yield index, delta
                if delta is not None:
                    pending[_next(streams[index])] = index
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _next(stream: AsyncIterator[Delta]) -> asyncio.Future:
    return asyncio.ensure_future(anext(stream, None))


async def close_generations(generations: list[Generation]) -> None:
    for generation in generations:
        await generation.aclose()


def merged_spec_stats(generations: list[Generation]) -> SpecStats:
    """The choices' speculative totals added up."""
    merged = SpecStats()
    for spec in (generation.spec for generation in generations if generation.spec):
        merged.num_drafts += spec.num_drafts
        merged.num_draft_tokens += spec.num_draft_tokens
        merged.num_accepted_tokens += spec.num_accepted_tokens
    return merged
