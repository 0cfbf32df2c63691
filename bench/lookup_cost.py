"""Unit-level cost of the CopySpec index: extend + lookup per token at two context lengths."""
from __future__ import annotations

import copy
import random
import time

from drafters.copyspec import CopyIndex

CONTEXT_LENGTHS = (1_000, 16_000)
NUM_ROUNDS = 40
TOKENS_PER_ROUND = 500  # short next to the context, so the context length stays nominal


def copyspec_lookup_cost(gamma: int, max_tokens: int, seed: int = 0) -> dict[str, float]:
    """Mean microseconds per generated token for extend + lookup, keyed by context length."""
    rng = random.Random(seed)
    result = {}
    for context_len in CONTEXT_LENGTHS:
        context = [rng.randrange(2_000) for _ in range(context_len)]  # small vocabulary: matches are common
        base = CopyIndex(gamma)
        base.extend(context)
        seconds = 0.0
        for _ in range(NUM_ROUNDS):
            index, tokens = copy.deepcopy(base), list(context)
            new_tokens = [rng.randrange(2_000) for _ in range(TOKENS_PER_ROUND)]
            start = time.perf_counter()
            for token in new_tokens:
                tokens.append(token)
                index.extend(tokens)
                index.continuation(tokens, max_tokens)
            seconds += time.perf_counter() - start
        result[str(context_len)] = seconds / (NUM_ROUNDS * TOKENS_PER_ROUND) * 1e6
    return result
