import pytest

from drafters.base import Draft
from drafters.copyspec import CopyIndex, CopySpecDrafter


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


def finished_turn(drafter, request_id, prompt, output):
    """One turn: begin, take its output, finish; returns the state the drafter hands its session."""
    req = Req(request_id, prompt)
    drafter.begin(req)
    req.all_token_ids += output
    drafter.extend(req, output)
    return drafter.finish(req)


def test_a_next_turn_resumes_the_index_and_copies_the_answer_as_generated():
    drafter = CopySpecDrafter(gamma=2, max_tokens=4)
    state = finished_turn(drafter, "t1", [1, 2, 3], [40, 41, 42, 43, 44])
    index = state.index
    # the client re-rendered the answer differently from what was generated (40 41 99 43 44), then asks again
    turn2 = Req("t2", [1, 2, 3, 40, 41, 42, 43, 44, 7, 40, 41])
    drafter.begin(turn2, state)
    assert drafter._corpora["t2"].index is index and index.num_indexed == len(turn2.all_token_ids)
    assert drafter.propose([turn2]) == [Draft([42, 43, 44, 7], "copyspec")]


def test_an_edited_turn_keeps_the_old_answer_to_copy_from():
    drafter = CopySpecDrafter(gamma=2, max_tokens=3)
    state = finished_turn(drafter, "t1", [1, 2, 3], [60, 61, 62, 63])
    edited = Req("t1-edited", [1, 5, 3])  # the user changed a word of turn 1 and asks again
    drafter.begin(edited, state)
    assert drafter._corpora["t1-edited"].corpus == [2, 3, 60, 61, 62, 63, 1, 5, 3]
    edited.all_token_ids += [60]
    drafter.extend(edited, [60])
    assert drafter.propose([edited]) == [Draft([61, 62, 63], "copyspec")]  # the old answer


def test_a_copy_source_stays_within_twice_the_context_over_many_edits():
    drafter = CopySpecDrafter(gamma=2, max_tokens=3)
    state = finished_turn(drafter, "t0", list(range(100, 130)), list(range(300, 310)))
    for edit in range(6):
        prompt = [100, 200 + edit] + list(range(102, 130))
        req = Req(f"e{edit}", prompt)
        drafter.begin(req, state)
        req.all_token_ids += list(range(300, 310))
        drafter.extend(req, list(range(300, 310)))
        assert len(drafter._corpora[req.request_id].corpus) <= 2 * len(req.all_token_ids)
        state = drafter.finish(req)
