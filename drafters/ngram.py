"""Learning-free n-grams (Stewart et al., "The N-Grammys", arXiv:2411.03786, §4.2-4.3).

Mixed strategy, as the paper builds it: up to k rows of w tokens from the context n-grams, then the extended model
bigram fills the rows that are left.
- Context n-grams, query length q = 1 (the paper finds q = 2, 3 worse): every full window of 1 + w tokens of the
  conversation that starts with the last token; identical windows count once, ranked by count, ties to the more
  recent (the paper's text; its code breaks ties arbitrarily). The index grows in O(w) per token.
- Model bigram (drafters/bigram.py): the top next tokens of a one-token forward, each extended with the table's
  argmax to w tokens; rows identical to a context row are dropped and the next bigram candidate takes their place.

The k rows are merged into one tree (drafters/tree.py; the paper verifies them as a batch): the same candidates in
fewer tokens. Beyond the paper, for the goodput planner, each token carries an acceptance estimate per row kind
(context: count 1 or 2+ and how many of the 3 tokens before it agree; bigram: rank) and depth, as row kinds differ
widely; every row of the last draft is scored against the target's next tokens. Sessions carry the context index
across turns like CopySpec's.
"""
from __future__ import annotations

import heapq
from typing import Sequence

from drafters.base import Draft, DraftableRequest
from drafters.bigram import BackgroundTable
from drafters.corpus import CorpusDrafter, SessionCorpus
from drafters.tree import merge_rows

QUERY_LEN = 1  # q: tokens matched at the end of the context
MAX_MATCH = 3  # tokens before a context window compared with those before the query, for its row kind
ROW_PRIOR = 0.3  # acceptance a row kind starts from, before any of its tokens were scored
ROW_PRIOR_WEIGHT = 4.0  # how many scored tokens the prior is worth


class ContextNgramIndex:
    """Every full window of QUERY_LEN + w tokens of a growing token list, grouped by its query tokens."""

    BYTES_PER_TOKEN = 407  # host memory per indexed token (tracemalloc, CPython 3.11, 4000 random-ish tokens, w = 10)

    def __init__(self, w: int) -> None:
        self.w = w
        # query -> continuation -> (count, last start)
        self.windows: dict[tuple[int, ...], dict[tuple[int, ...], tuple[int, int]]] = {}
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

    @property
    def num_bytes(self) -> int:
        return self.BYTES_PER_TOKEN * self.num_indexed

    def top_windows(self, token_ids: Sequence[int], k: int) -> list[tuple[tuple[int, ...], int, int]]:
        """Up to k (continuation, count, last start) after the last QUERY_LEN tokens: most frequent first, ties to
        the most recent."""
        counts = self.windows.get(tuple(token_ids[len(token_ids) - QUERY_LEN:]), {})
        best = heapq.nlargest(k, counts.items(), key=lambda item: item[1])
        return [(continuation, count, start) for continuation, (count, start) in best]

    def top(self, token_ids: Sequence[int], k: int) -> list[list[int]]:
        return [list(continuation) for continuation, _, _ in self.top_windows(token_ids, k)]


class RowRates:
    """Running acceptance of the drafter's rows, per row kind and depth, scored against the target's tokens.

    A row's token at depth d is scored when the row's tokens before it were the target's: its first token every
    step, verified or not. The rate at (kind, d) shrinks towards (kind, d - 1), and (kind, 1) towards ROW_PRIOR.
    Counts are kept per kind as lists by depth: a draft asks for each of its kinds' rates at every depth each step.
    """

    def __init__(self) -> None:
        self._counts: dict[str, tuple[list[int], list[int]]] = {}  # kind -> (tried, hits), index depth - 1

    def counts(self, kind: str, depth: int) -> tuple[int, int]:
        """(tried, hits) of KIND's tokens at DEPTH."""
        tried, hits = self._counts.get(kind, ((), ()))
        return (tried[depth - 1], hits[depth - 1]) if depth <= len(tried) else (0, 0)

    def scored(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(kind, depth) -> (tried, hits), for every depth of a kind scored at least once."""
        return {(kind, depth): (n, hits[depth - 1]) for kind, (tried, hits) in self._counts.items()
                for depth, n in enumerate(tried, start=1) if n}

    def rate(self, kind: str, depth: int, shared: RowRates | None = None) -> float:
        return self.rates(kind, depth, shared)[-1]

    def rates(self, kind: str, max_depth: int, shared: RowRates | None = None) -> list[float]:
        """[max_depth] the rate at depths 1 .. max_depth, each shrunk towards the one before, or, given SHARED
        (wider statistics: these are one request's), towards SHARED's rate at the same depth."""
        tried, hits = self._counts.get(kind, ((), ()))
        priors = shared.rates(kind, max_depth) if shared is not None else None
        result, prior = [], ROW_PRIOR
        for index in range(min(len(tried), max_depth)):
            if priors is not None:
                prior = priors[index]
            prior = (hits[index] + prior * ROW_PRIOR_WEIGHT) / (tried[index] + ROW_PRIOR_WEIGHT)
            result.append(prior)
        if len(result) < max_depth:  # depths never scored keep their prior
            result += priors[len(result):] if priors is not None else [prior] * (max_depth - len(result))
        return result

    def estimates(self, keys: Sequence[tuple[str, int]], shared: RowRates | None = None) -> list[float]:
        """The rate at each (kind, depth) of KEYS, each kind's rates computed once down to its deepest key."""
        deepest: dict[str, int] = {}
        for kind, depth in keys:
            if deepest.get(kind, 0) < depth:
                deepest[kind] = depth
        by_kind = {kind: self.rates(kind, depth, shared) for kind, depth in deepest.items()}
        return [by_kind[kind][depth - 1] for kind, depth in keys]

    def add(self, kind: str, depth: int, hit: bool) -> None:
        """Count one token of KIND scored at DEPTH, right (HIT) or not."""
        tried, hits = self._counts.setdefault(kind, ([], []))
        if len(tried) < depth:
            tried.extend([0] * (depth - len(tried)))
            hits.extend([0] * (depth - len(hits)))
        tried[depth - 1] += 1
        hits[depth - 1] += hit

    def score(self, rows: list[tuple[list[int], str]], target_token_ids: Sequence[int]) -> None:
        for row, kind in rows:
            for depth, (token, target) in enumerate(zip(row, target_token_ids), start=1):
                self.add(kind, depth, token == target)
                if token != target:
                    break

    def score_walk(self, walk: Sequence[tuple[int, int, bool]], kinds: Sequence[str]) -> None:
        """Score the (node, depth, hit) of a tree's scored_walk, each node of its kind in KINDS."""
        for node, depth, hit in walk:
            self.add(kinds[node], depth, hit)


class NgramDrafter(CorpusDrafter[ContextNgramIndex]):
    name = "ngram"

    def __init__(self, k: int = 10, w: int = 10, bigram: BackgroundTable | None = None) -> None:
        super().__init__(lambda: ContextNgramIndex(w))
        self.k = k  # rows
        self.w = w  # tokens per row
        self.bigram = bigram  # None: context n-grams only
        self.rates = RowRates()
        self._proposed: dict[str, list[tuple[list[int], str]]] = {}  # request id -> its last draft's rows and kinds

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        """The step's tokens are the target's next ones: they score the last draft's rows, then join the corpus."""
        self.rates.score(self._proposed.pop(req.request_id, []), new_token_ids)
        super().extend(req, new_token_ids)

    def draft(self, request_id: str, corpus: SessionCorpus[ContextNgramIndex]) -> Draft:
        rows = self._rows(corpus)
        self._proposed[request_id] = rows  # scored against the target's tokens at the next extend
        return self._tree(rows)

    def _rows(self, corpus: SessionCorpus[ContextNgramIndex]) -> list[tuple[list[int], str]]:
        """The mixed strategy's rows, each with its kind: context windows first, then the bigram's."""
        tokens = corpus.corpus
        rows = [(list(continuation), context_kind(tokens, count, start))
                for continuation, count, start in corpus.index.top_windows(tokens, self.k)]
        bigram = self._bigram_rows(tokens[-1], [row for row, _ in rows])
        return rows + [(row, f"bigram:rank{min(rank, MAX_MATCH)}") for rank, row in enumerate(bigram)]

    def _tree(self, rows: list[tuple[list[int], str]]) -> Draft:
        """The rows merged into one tree; a token shared by several rows takes the best of their estimates."""
        token_ids, parents, paths = merge_rows([row for row, _ in rows])
        estimates = [0.0] * len(token_ids)
        for (_, kind), path in zip(rows, paths):
            for node, rate in zip(path, self.rates.rates(kind, len(path))):
                estimates[node] = max(estimates[node], rate)
        return Draft(token_ids, self.name, parents, estimates)

    def _bigram_rows(self, last_token: int, context_rows: list[list[int]]) -> list[list[int]]:
        """The extended bigram's rows that fill what the context left of k, none repeating a context row."""
        table = self.bigram.table if self.bigram else None
        num_missing = self.k - len(context_rows)
        if table is None or num_missing <= 0:
            return []
        taken = {tuple(row) for row in context_rows}
        fresh = [row for row in table.rows(last_token, len(context_rows) + self.k, self.w) if tuple(row) not in taken]
        return fresh[:num_missing]

    def finish(self, req: DraftableRequest) -> SessionCorpus | None:
        self._proposed.pop(req.request_id, None)
        return super().finish(req)


def context_kind(tokens: Sequence[int], count: int, start: int) -> str:
    """A context row's kind: its window's count (1 or more) and how many tokens before the window agree with those
    before the query (0 .. MAX_MATCH)."""
    query = len(tokens) - QUERY_LEN
    match = 0
    while match < MAX_MATCH and start - 1 - match >= 0 and tokens[start - 1 - match] == tokens[query - 1 - match]:
        match += 1
    return f"context:count{'2+' if count > 1 else '1'}:match{match}"
