"""Prompt lookup as Spec-Bench runs it: the longest suffix (3, 2, 1) matched first, the first match that has a whole
continuation of K tokens, never the suffix itself."""
from dataclasses import dataclass, field

import pytest

from drafters.pld import NgramPositions, PromptLookupDrafter


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)


def continuation(tokens, k):
    index = NgramPositions()
    index.extend(tokens)
    return index.first_continuation(tokens, k)


@pytest.mark.parametrize(
    "tokens, k, expected",
    [
        ([1, 2, 3, 9, 8, 1, 2, 3], 2, [9, 8]),  # the 3-gram 1 2 3 matches
        ([7, 2, 3, 5, 6, 1, 2, 3], 2, [5, 6]),  # no 3-gram: the 2-gram 2 3
        ([4, 3, 1, 6, 9, 9, 3], 2, [1, 6]),  # only the last token 3
        ([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3], 2, [9, 1]),  # the first match wins, not the most recent
        ([5, 1, 2, 3, 1, 2, 3], 2, [1, 2]),  # the 3-gram's copy would start at the suffix: the 2-gram 2 3 answers
        ([1, 2, 3], 2, []),  # only the suffix itself
        # 5 tokens after the match would run into the suffix's end: no whole continuation
        ([9, 1, 2, 3, 4, 1, 2, 3], 5, []),
    ],
)
def test_lookup(tokens, k, expected):
    assert continuation(tokens, k) == expected


def test_incremental_indexing_equals_indexing_at_once():
    tokens = [(i * 5) % 7 for i in range(40)]
    at_once, step = NgramPositions(), NgramPositions()
    at_once.extend(tokens)
    for end in range(1, len(tokens) + 1):
        step.extend(tokens[:end])
    assert at_once.starts == step.starts


def test_the_drafter_copies_from_the_prompt_and_its_own_output():
    drafter = PromptLookupDrafter(num_tokens=2)
    req = Req("r", [1, 2, 3, 4, 5, 1, 2])
    drafter.begin(req)
    assert drafter.propose([req])[0].token_ids == [3, 4]
    req.all_token_ids += [6]
    drafter.extend(req, [6])
    assert len(drafter.propose([req])[0]) == 0  # 6 never came before: no draft, no dummy token
