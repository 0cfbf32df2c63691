"""Incremental detokenization and stop strings for one generated sequence.

IncrementalDetokenizer turns token ids, fed a few at a time, into text deltas whose
concatenation equals decoding all generated ids at once (special tokens skipped).
It uses the prefix-offset method (as vLLM does): decode a short window of already
emitted tokens with and without the new ones and emit the difference, so that
tokenizers whose decoding depends on the neighbouring token (SentencePiece's leading
"▁", byte-level BPE) neither drop nor duplicate characters, and text ending in an
incomplete UTF-8 sequence ("\ufffd") is held back until it completes.

StopChecker applies OpenAI stop strings to those deltas: it holds back a tail that
may be the start of a stop string and, on a match, truncates before the stop string.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._token_ids: list[int] = []  # [num_generated] every id fed so far
        self._prefix_offset = 0  # decode window start: emitted tokens kept as context
        self._read_offset = 0  # ids before this are emitted as text

    @property
    def token_ids(self) -> list[int]:
        return self._token_ids

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Feed new ids; return the text they complete ("" while a character is partial)."""
        self._token_ids.extend(new_token_ids)
        prefix_text, full_text = self._window_texts()
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end of the sequence: the held-back text, incomplete characters included."""
        prefix_text, full_text = self._window_texts()
        self._advance()
        return full_text[len(prefix_text):]

    def _window_texts(self) -> tuple[str, str]:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        return prefix_text, full_text

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(
            token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )


class StopChecker:
    """Cuts a text stream at the first stop string (which is not emitted)."""

    def __init__(self, stop: Sequence[str] | None) -> None:
        self._stop = [s for s in (stop or ()) if s]
        self._max_held = max((len(s) for s in self._stop), default=1) - 1  # chars
        self._held = ""  # tail that may begin a stop string
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        pending = self._held + text
        stop_index = self._first_stop_index(pending)
        if stop_index is not None:
            self._held, self.stopped = "", True
            return pending[:stop_index], True
        num_held = self._partial_match_len(pending)
        self._held = pending[len(pending) - num_held :]
        return pending[: len(pending) - num_held], False

    def flush(self) -> str:
        """At the end of the sequence (no stop string hit): release the held-back tail."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_stop_index(self, text: str) -> int | None:
        indices = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(indices) if indices else None

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._max_held), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0
