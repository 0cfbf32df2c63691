"""Learning-free n-grams (Ou et al., "Lossless acceleration of LLMs with learning-free n-grams", §4.2-4.3).

Mixed strategy, as the paper builds it: up to k rows of w tokens from the context
n-grams first, then the extended model bigram fills the rows that are left.

- Context n-grams, query length q = 1 (q = 2, 3 were worse in the paper): every full
  window of 1 + w tokens anywhere in the conversation (prompt, history, output) that
  starts with the last token; identical windows counted once, ranked by how often
  they occur, ties to the more recent (the paper's text; its code breaks ties
  arbitrarily). An index keeps, per first token, each continuation's count and last
  start; each new token completes one window, so the index grows in O(w) per token.
- Model bigram (drafters/bigram.py): the top next tokens of a one-token forward, each
  extended with the table's argmax to w tokens. Rows identical to a context row are
  dropped (NOTES.md), and the next bigram candidate takes their place.

The paper verifies the k rows as a batch; merging their shared prefixes into one tree
(drafters/tree.py) verifies the same candidates with fewer tokens and accepts the same
greedy output. Sessions carry the context index across turns like CopySpec's.
"""
from __future__ import annotations

import heapq
from typing import Sequence

from drafters.base import Draft
from drafters.bigram import BackgroundTable
from drafters.corpus import CorpusDrafter, SessionCorpus
from drafters.tree import merge_rows

QUERY_LEN = 1  # q: tokens matched at the end of the context


class ContextNgramIndex:
    """Every full window of QUERY_LEN + w tokens of a growing token list, grouped by its query tokens."""

    def __init__(self, w: int) -> None:
        self.w = w
        self.windows: dict[tuple[int, ...], dict[tuple[int, ...], tuple[int, int]]] = {}  # query -> continuation -> (count, last start)
        self.num_indexed = 0  # tokens of the list already covered

    def extend(self, token_ids: Sequence[int]) -> None:
        """Count the windows that the tokens appended since the last call complete."""
        span = QUERY_LEN + self.w
        for start in range(max(self.num_indexed - span + 1, 0), len(token_ids) - span + 1):
            query = tuple(token_ids[start:start + QUERY_LEN])
            continuation = tuple(token_ids[start + QUERY_LEN:start + span])
            counts = self.windows.setdefault(query, {})
            count, _ = counts.get(continuation, (0, 0))
            counts[continuation] = (count + 1, start)
        self.num_indexed = len(token_ids)

    def top(self, token_ids: Sequence[int], k: int) -> list[list[int]]:
        """Up to k continuations of the last QUERY_LEN tokens: most frequent first, ties to the most recent."""
        counts = self.windows.get(tuple(token_ids[len(token_ids) - QUERY_LEN:]), {})
        best = heapq.nlargest(k, counts.items(), key=lambda item: item[1])
        return [list(continuation) for continuation, _ in best]


class NgramDrafter(CorpusDrafter[ContextNgramIndex]):
    name = "ngram"

    def __init__(self, k: int = 10, w: int = 10, bigram: BackgroundTable | None = None) -> None:
        super().__init__(lambda: ContextNgramIndex(w))
        self.k = k  # rows
        self.w = w  # tokens per row
        self.bigram = bigram  # None: context n-grams only

    def draft(self, corpus: SessionCorpus[ContextNgramIndex]) -> Draft:
        rows = corpus.index.top(corpus.corpus, self.k)
        rows += self._bigram_rows(corpus.corpus[-1], rows)
        token_ids, parents = merge_rows(rows)
        return Draft(token_ids, self.name, parents)

    def _bigram_rows(self, last_token: int, context_rows: list[list[int]]) -> list[list[int]]:
        """The extended bigram's rows that fill what the context left of k, none repeating a context row."""
        table = self.bigram.table if self.bigram else None
        num_missing = self.k - len(context_rows)
        if table is None or num_missing <= 0:
            return []
        taken = {tuple(row) for row in context_rows}
        fresh = [row for row in table.rows(last_token, len(context_rows) + self.k, self.w) if tuple(row) not in taken]
        return fresh[:num_missing]
