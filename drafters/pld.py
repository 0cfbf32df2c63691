"""Prompt lookup decoding (Saxena 2023), as Spec-Bench and the PLD+ paper run it: the baseline PLD+ is compared with.

Match the last 3 tokens anywhere earlier in the conversation, backing off to the last
2, then the last 1; take the first match (earliest) whose whole continuation of K
tokens lies in the context and does not start inside the matched suffix; draft those
K tokens. Spec-Bench's code drafts a dummy token when nothing matches; the goodput
planner needs no such token, so an empty draft stands for "nothing to copy".

An index per n-gram size keeps every start position of every n-gram in order, so a
lookup scans the positions of one n-gram only; it grows by O(n) per token.
"""
from __future__ import annotations

from typing import Sequence

from drafters.base import Draft
from drafters.corpus import CorpusDrafter, SessionCorpus

MAX_NGRAM = 3  # the longest suffix matched; backs off to 1
DEFAULT_NUM_TOKENS = 10  # K


class NgramPositions:
    """Start positions, in order, of every n-gram of sizes 1..MAX_NGRAM of a growing token list."""

    BYTES_PER_TOKEN = 615  # host memory per indexed token (tracemalloc, CPython 3.11, 4000 random-ish tokens)

    def __init__(self) -> None:
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its start positions, ascending
        self.num_indexed = 0

    def extend(self, token_ids: Sequence[int]) -> None:
        for end in range(self.num_indexed + 1, len(token_ids) + 1):
            for n in range(1, min(MAX_NGRAM, end) + 1):
                self.starts.setdefault(tuple(token_ids[end - n:end]), []).append(end - n)
        self.num_indexed = len(token_ids)

    @property
    def num_bytes(self) -> int:
        return self.BYTES_PER_TOKEN * self.num_indexed

    def first_continuation(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """The K tokens after the first earlier match of the longest suffix (3, then 2, then 1) that has them all."""
        length = len(token_ids)
        for n in range(min(MAX_NGRAM, length - 1), 0, -1):
            for start in self.starts.get(tuple(token_ids[length - n:]), ()):
                copy_from = start + n
                if copy_from >= length - n:  # the suffix itself, or a match overlapping it: nothing further qualifies
                    break
                if copy_from + num_tokens <= length:
                    return list(token_ids[copy_from:copy_from + num_tokens])
        return []


class PromptLookupDrafter(CorpusDrafter[NgramPositions]):
    name = "pld"

    def __init__(self, num_tokens: int = DEFAULT_NUM_TOKENS) -> None:
        super().__init__(NgramPositions)
        self.num_tokens = num_tokens

    def draft(self, request_id: str, corpus: SessionCorpus[NgramPositions]) -> Draft:
        return Draft(corpus.index.first_continuation(corpus.corpus, self.num_tokens), self.name)
