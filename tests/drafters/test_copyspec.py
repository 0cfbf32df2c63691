import pytest

from drafters.base import Draft
from drafters.config import SpecConfig
from drafters.copyspec import CopyIndex, CopySpecDrafter
from drafters.registry import build_drafter


class Req:
    def __init__(self, request_id, token_ids):
        self.request_id = request_id
        self.all_token_ids = list(token_ids)


@pytest.mark.parametrize(
    "tokens, gamma, max_tokens, expected",
    [
        ([1, 2, 3, 4, 5, 9, 1, 2, 3], 3, 10, [4, 5, 9, 1, 2, 3]),  # copies up to the end of the context
        ([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], 3, 2, [4, 5]),  # at most |S| tokens
        ([1, 2, 3, 4, 1, 2, 3, 7, 1, 2, 3], 3, 10, [4, 1, 2, 3, 7, 1, 2, 3]),  # the first occurrence wins
        ([1, 2, 3, 4, 5, 6], 3, 10, []),  # the last γ tokens never occurred before
        ([7, 7, 7, 7], 3, 10, []),  # the only earlier occurrence overlaps the suffix
        ([7, 7, 7, 7, 7, 7], 3, 10, [7, 7, 7]),  # a non-overlapping earlier occurrence exists
        ([1, 2], 3, 10, []),  # shorter than γ
        ([5, 6, 8, 5, 6], 2, 10, [8, 5, 6]),  # other γ
    ],
)
def test_continuation(tokens, gamma, max_tokens, expected):
    index = CopyIndex(gamma)
    index.extend(tokens)
    assert index.continuation(tokens, max_tokens) == expected


def test_incremental_extend_equals_bulk_index():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5] * 3
    bulk, incremental = CopyIndex(3), CopyIndex(3)
    bulk.extend(tokens)
    for end in range(len(tokens) + 1):
        incremental.extend(tokens[:end])
    assert incremental.first_start == bulk.first_start
    assert incremental.num_indexed == len(tokens)


def test_drafter_follows_accepted_tokens_and_forgets_finished_requests():
    drafter = CopySpecDrafter(gamma=2, max_tokens=3)
    req = Req("a", [10, 11, 12, 13, 14, 20])
    drafter.begin(req)
    assert drafter.propose([req]) == [Draft([], "copyspec")]
    req.all_token_ids += [10, 11]
    drafter.extend(req, [10, 11])
    assert drafter.propose([req]) == [Draft([12, 13, 14], "copyspec")]
    drafter.finish(req)
    with pytest.raises(KeyError):
        drafter.propose([req])


def test_requests_do_not_share_an_index():
    drafter = CopySpecDrafter(gamma=2, max_tokens=4)
    first, second = Req("a", [1, 2, 3, 4]), Req("b", [9, 1, 2])
    drafter.begin(first)
    drafter.begin(second)
    assert drafter.propose([first, second]) == [Draft([], "copyspec"), Draft([], "copyspec")]


def test_registry_builds_by_name():
    assert build_drafter(SpecConfig(drafter="none")) is None
    drafter = build_drafter(SpecConfig(drafter="copyspec", copy_gamma=5, copy_max_tokens=7))
    assert (drafter.gamma, drafter.max_tokens) == (5, 7)
    with pytest.raises(ValueError, match="unknown drafter"):
        build_drafter(SpecConfig(drafter="nope"))
