"""The served model's own confident next tokens after short contexts: a table `specserve calibrate corpus` builds from
the target's predictions over the calibration text, and SPECTRA-retrieval drafts from.

For each context of 1 .. CONTEXT_TOKENS tokens the calibration text holds, the target predicted a next token at every
position the context ended; the table keeps the prediction whose probabilities summed highest and, as its
confidence, that sum over the context's occurrences (the target's mean probability of the token there). Entries
below MIN_CONFIDENCE are dropped. A guess runs a token at a time from the longest context of the conversation and the
guess so far that the table holds, as far as it knows one.

Why: sampled at T = 1, a chat answer is new text, so the conversation's own n-grams rarely guess it; what can be
guessed is where the model itself is sure (the rest of a word, the syntax after a keyword), and a drafted token
there is accepted with about the probability the target gives it. Replaying the target's T = 1 answers to 20
questions per set against a table built from its T = 1 answers to 400 training prompts (82k tokens), a depth-1
guess where the table knows one is accepted 0.26 / 0.30 / 0.30 of the time on MT-Bench / HumanEval / GSM8K (on
20 / 39 / 31 % of positions: 0.05 / 0.12 / 0.09 tokens per position); the stored confidence overstates the
acceptance (0.96 against 0.55 in its top bin: three tokens do not fix what the model predicts), so each guess is
scored under the kind of its first token's confidence (`kind`) and the planner prices it by what that kind really
accepted.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import itemgetter

from drafters.base import follow_longest_contexts

CONTEXT_TOKENS = 3  # the longest context a table entry has (4 guessed no better in the replay above)
# entries the target predicted less surely than this are dropped (a verified row costs ~0.15 of a CPU step)
MIN_CONFIDENCE = 0.3
GUESS_TOKENS = 4  # the longest guess (the planner prices each deeper token by its kind's rate at its depth)
BYTES_PER_ENTRY = 150  # host memory of an entry (tracemalloc, CPython 3.11: 148 over a calibrated table of 84k)

Context = tuple[int, ...]


class ModelNgrams:
    """Context -> (the target's most likely next token after it, its confidence)."""

    def __init__(self, entries: dict[Context, tuple[int, float]], context_tokens: int = CONTEXT_TOKENS) -> None:
        self.entries = entries
        self.context_tokens = context_tokens

    @classmethod
    def from_predictions(cls, sequences: Iterable[tuple[Sequence[int], Sequence[int], Sequence[float]]],
                         min_confidence: float = MIN_CONFIDENCE, max_bytes: int | None = None,
                         context_tokens: int = CONTEXT_TOKENS) -> ModelNgrams:
        """SEQUENCES: (token ids, the target's most likely token after each of them, its probability there). Keeps
        the surest entries first when MAX_BYTES bounds the table."""
        sums: dict[Context, dict[int, float]] = {}
        counts: dict[Context, int] = {}
        for token_ids, predicted, probabilities in sequences:
            for end, (token, probability) in enumerate(zip(predicted, probabilities), start=1):
                for length in range(1, min(context_tokens, end) + 1):
                    context = tuple(token_ids[end - length:end])
                    by_token = sums.setdefault(context, {})
                    by_token[token] = by_token.get(token, 0.0) + probability
                    counts[context] = counts.get(context, 0) + 1
        entries = {}
        for context, by_token in sums.items():
            token, total = max(by_token.items(), key=lambda item: item[1])
            confidence = total / counts[context]
            if confidence >= min_confidence:
                entries[context] = (token, confidence)
        if max_bytes is not None and len(entries) * BYTES_PER_ENTRY > max_bytes:
            surest = sorted(entries.items(), key=lambda item: -item[1][1])[:max_bytes // BYTES_PER_ENTRY]
            entries = dict(surest)
        return cls(entries, context_tokens)

    @property
    def num_bytes(self) -> int:
        return BYTES_PER_ENTRY * len(self.entries)

    def guess(self, token_ids: Sequence[int], max_tokens: int = GUESS_TOKENS) -> tuple[list[int], float]:
        """Up to MAX_TOKENS tokens after TOKEN_IDS, each the entry of the longest context (of their last tokens and
        the guess so far) the table holds; and the first token's confidence (0.0: no guess)."""
        steps = follow_longest_contexts(self.entries, token_ids, self.context_tokens, max_tokens, itemgetter(0))
        guess = [token for _, (token, _) in steps]
        first_confidence = steps[0][1][1] if steps else 0.0
        return guess, first_confidence

    def to_json(self) -> list[list[float]]:
        """[[context..., token, confidence], ...]"""
        return [[*context, token, round(confidence, 4)] for context, (token, confidence) in self.entries.items()]

    @classmethod
    def from_json(cls, rows: list[list[float]], context_tokens: int = CONTEXT_TOKENS) -> ModelNgrams:
        return cls({tuple(int(t) for t in row[:-2]): (int(row[-2]), float(row[-1])) for row in rows}, context_tokens)


def kind(confidence: float) -> str:
    """A guess's acceptance statistics' key: its first token's confidence, in tenths."""
    return f"model:conf{min(int(confidence * 10), 9)}"
