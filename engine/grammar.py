"""Grammars that every emitted token of a request must follow (structured outputs, forced tool calls), by llguidance.

Why llguidance rather than xgrammar: it computes each mask lazily from the parser state (no per-grammar compilation of
a full token automaton, which for a large JSON schema takes seconds in xgrammar), ships as one self-contained abi3
wheel with no torch or compiler dependency, rolls back and validates token lists without changing state (what
speculation needs), and is what llama.cpp and vLLM use for Lark grammars.

A request's matcher follows its committed tokens: verification asks for the mask at each position it walks (the
target's distribution is masked before the token is chosen, drafted position or not) and then consumes the chosen
token. Drafts are cut to their grammatical part before verification, so a forbidden drafted token is never computed;
`validate_tokens` checks a path without consuming it, so nothing needs rolling back after a cut.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer

from drafters.base import Draft
from drafters.tree import ROOT, is_chain, subtree


class GrammarError(ValueError):
    """The grammar does not compile (the server checks grammars first: server/structured.py)."""


class Grammars:
    """The matchers of the requests that have a grammar, keyed by request id."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: list[int]) -> None:
        self._load_tokenizer = load_tokenizer  # called once, at the first grammar (about a second)
        self._vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._eos_token_ids = eos_token_ids
        self._tokenizer = None
        self._matchers: dict[str, Any] = {}

    def begin(self, request_id: str, grammar: str) -> None:
        """Raises GrammarError when the grammar does not compile."""
        matcher = LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        self._matchers[request_id] = matcher

    def has(self, request_id: str) -> bool:
        return request_id in self._matchers

    def allowed(self, request_id: str) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next (EOS once it is complete)."""
        bits = np.frombuffer(self._matchers[request_id].compute_bitmask(), dtype=np.uint8)
        tokenizer_allowed = np.unpackbits(bits, bitorder="little")[:self._vocab_size]
        allowed = np.zeros(self._vocab_size, dtype=bool)  # logits past the tokenizer's vocabulary stay forbidden
        allowed[:len(tokenizer_allowed)] = tokenizer_allowed
        return torch.from_numpy(allowed)

    def consume(self, request_id: str, token_id: int) -> None:
        self._matchers[request_id].consume_token(token_id)

    def cut_draft(self, request_id: str, draft: Draft) -> Draft:
        """The draft's nodes whose whole root path the grammar allows from the committed tokens, as a draft."""
        matcher = self._matchers[request_id]
        if is_chain(draft.parents):
            return _prefix(draft, matcher.validate_tokens(draft.token_ids))
        kept = [node for node in range(len(draft)) if _path_allowed(matcher, draft, node)]
        return _subdraft(draft, kept)

    def finish(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def _ll_tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = from_tokenizer(self._load_tokenizer(), eos_token=self._eos_token_ids)
        return self._tokenizer


def _path_allowed(matcher, draft: Draft, node: int) -> bool:
    path = []
    while node != ROOT:
        path.append(draft.token_ids[node])
        node = draft.parents[node]
    return matcher.validate_tokens(path[::-1]) == len(path)


def _prefix(draft: Draft, num_tokens: int) -> Draft:
    if num_tokens == len(draft):
        return draft
    return _subdraft(draft, list(range(num_tokens)))


def _subdraft(draft: Draft, kept: list[int]) -> Draft:
    acceptance = [draft.acceptance[n] for n in kept] if draft.acceptance is not None else None
    return Draft([draft.token_ids[n] for n in kept], draft.source, subtree(draft.parents, kept), acceptance)
