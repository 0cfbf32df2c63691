"""CopySpec (Dumitru et al. 2025, §3.1-3.2): copy what followed an earlier occurrence of the last γ tokens.

A hash map holds the first position of every γ-token subsequence of the request's
context. Each accepted token adds one γ-gram (O(γ)), and each proposal is one
lookup of the last γ tokens (O(γ)), independent of the context length.

With session caches the index outlives a turn (§3.3: the whole chat history): the
next turn of the conversation resumes it with the tokens as generated, and adds only
its new tokens (drafters/corpus.py, which also keeps an edited turn's old version).
"""
from __future__ import annotations

from typing import Sequence

from drafters.base import Draft
from drafters.corpus import CorpusDrafter, SessionCorpus


class CopyIndex:
    """First occurrence of every γ-gram of a growing token list."""

    BYTES_PER_TOKEN = 131  # host memory per indexed token (tracemalloc, CPython 3.11, 4000 random-ish tokens, γ = 3)

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        self.first_start: dict[tuple[int, ...], int] = {}  # γ-gram -> start position of its first occurrence
        self.num_indexed = 0  # tokens of the list already covered

    def extend(self, token_ids: Sequence[int]) -> None:
        """Index the γ-grams that end at the tokens appended since the last call."""
        gamma = self.gamma
        for end in range(max(self.num_indexed + 1, gamma), len(token_ids) + 1):
            self.first_start.setdefault(tuple(token_ids[end - gamma:end]), end - gamma)
        self.num_indexed = len(token_ids)

    @property
    def num_bytes(self) -> int:
        return self.BYTES_PER_TOKEN * self.num_indexed

    def continuation(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The tokens after the first earlier, non-overlapping occurrence of the last γ tokens."""
        gamma, length = self.gamma, len(token_ids)
        if length < 2 * gamma:
            return []
        start = self.first_start.get(tuple(token_ids[length - gamma:]))
        if start is None or start + gamma > length - gamma:
            return []
        copy_from = start + gamma
        return list(token_ids[copy_from:min(copy_from + max_tokens, length)])


class CopySpecDrafter(CorpusDrafter[CopyIndex]):
    name = "copyspec"

    def __init__(self, gamma: int = 3, max_tokens: int = 10) -> None:
        super().__init__(lambda: CopyIndex(gamma))
        self.gamma = gamma
        self.max_tokens = max_tokens

    def draft(self, request_id: str, corpus: SessionCorpus[CopyIndex]) -> Draft:
        return Draft(corpus.index.continuation(corpus.corpus, self.max_tokens), self.name)
