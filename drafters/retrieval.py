"""A retrieval index over token documents for SPECTRA-RETRIEVAL's guesses (drafters/spectra.py): searched with the
last tokens of a request's context, it returns what followed the longest matches of them in its documents.

The paper keeps a trie over its corpus (REST's design); this keeps the same search as a hash of every KEY_TOKENS-gram
to its latest positions (at most POSITIONS_PER_KEY, newest first) and measures each position's match backwards
through the document, up to MAX_MATCH tokens: the longest match wins, then the newest document. Continuations that
one already taken covers (a prefix of it) are left out.

The index is bounded in bytes: documents go oldest first once the bound is passed. SPECTRA's global traffic index is
one of these fed with every finished response (what SuffixDecoding does in vLLM and ArcticInference, and llama.cpp's
ngram-mod across slots): one request's output then drafts another's that repeats it — the same tool-call skeleton,
the same JSON record edited again — although no single conversation holds it.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Sequence

KEY_TOKENS = 3  # tokens of the context's end a position is found by (CopySpec's γ)
MAX_MATCH = 16  # tokens a match is measured back to
POSITIONS_PER_KEY = 8  # the newest positions kept per key
TOKEN_BITS = 21  # a key packs its tokens into one int: vocabularies up to 2M tokens
# host memory per indexed token: the document's 8-byte slot, its key's share of the hash and its position entry
# (tracemalloc, CPython 3.11, random tokens so that every key is new: 191 bytes, 217 once evictions have left the
# hash its free slots; rounded up)
BYTES_PER_TOKEN = 230


def _key(tokens: Sequence[int]) -> int:
    """KEY_TOKENS tokens as one int (an int key takes a third of a tuple's memory)."""
    key = 0
    for token in tokens:
        key = key << TOKEN_BITS | token
    return key


class SuffixIndex:
    """Documents of tokens, searched by the longest suffix of a context they hold; at most MAX_BYTES, oldest out."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._documents: OrderedDict[int, array] = OrderedDict()  # id -> tokens, oldest first
        self._positions: dict[int, list[int]] = {}  # key -> positions (id << 32 | index after it), newest last
        self._next_id = 0
        self.num_tokens = 0

    @property
    def num_bytes(self) -> int:
        return BYTES_PER_TOKEN * self.num_tokens

    @property
    def num_documents(self) -> int:
        return len(self._documents)

    def add(self, token_ids: Sequence[int]) -> None:
        """Index a document (one too short to continue a key, or larger than the bound, is not kept)."""
        if len(token_ids) <= KEY_TOKENS or BYTES_PER_TOKEN * len(token_ids) > self.max_bytes:
            return
        doc_id, self._next_id = self._next_id, self._next_id + 1
        tokens = array("q", token_ids)
        self._documents[doc_id] = tokens
        self.num_tokens += len(tokens)
        for end in range(KEY_TOKENS, len(tokens)):
            entries = self._positions.setdefault(_key(tokens[end - KEY_TOKENS:end]), [])
            entries.append(doc_id << 32 | end)
            if len(entries) > POSITIONS_PER_KEY:
                del entries[0]
        while self.num_bytes > self.max_bytes:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        doc_id, tokens = self._documents.popitem(last=False)
        self.num_tokens -= len(tokens)
        for end in range(KEY_TOKENS, len(tokens)):
            key = _key(tokens[end - KEY_TOKENS:end])
            entries = self._positions.get(key)
            if entries is None:
                continue
            entries[:] = [entry for entry in entries if entry >> 32 != doc_id]
            if not entries:
                del self._positions[key]

    def search(self, context: Sequence[int], max_guesses: int, max_tokens: int) -> list[tuple[list[int], int]]:
        """Up to MAX_GUESSES continuations of up to MAX_TOKENS tokens of CONTEXT's end, each with the length of the
        match it follows: longest match first, then newest; none that an earlier one covers."""
        if len(context) < KEY_TOKENS:
            return []
        entries = self._positions.get(_key(context[-KEY_TOKENS:]))
        if not entries:
            return []
        ranked = []
        for recency, entry in enumerate(reversed(entries)):
            doc_id, end = entry >> 32, entry & 0xFFFFFFFF
            ranked.append((-self._match_length(context, self._documents[doc_id], end), recency, doc_id, end))
        ranked.sort()
        guesses: list[tuple[list[int], int]] = []
        for negative_match, _, doc_id, end in ranked:
            continuation = list(self._documents[doc_id][end:end + max_tokens])
            if continuation and not any(taken[:len(continuation)] == continuation for taken, _ in guesses):
                guesses.append((continuation, -negative_match))
                if len(guesses) == max_guesses:
                    break
        return guesses

    @staticmethod
    def _match_length(context: Sequence[int], tokens: array, end: int) -> int:
        """How many tokens before END in TOKENS equal CONTEXT's last ones (at least KEY_TOKENS, the key)."""
        length = KEY_TOKENS
        limit = min(MAX_MATCH, end, len(context))
        while length < limit and tokens[end - length - 1] == context[-length - 1]:
            length += 1
        return length
