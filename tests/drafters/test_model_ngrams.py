"""The table of the model's own confident next tokens: how predictions aggregate per context, what is dropped, the
longest-context guess, its bound and its JSON form; and SPECTRA drafting from it."""
from types import SimpleNamespace

import pytest

from drafters.model_ngrams import BYTES_PER_ENTRY, ModelNgrams, kind
from drafters.spectra import SpectraDrafter


def test_each_context_keeps_the_prediction_whose_probabilities_sum_highest():
    # after token 5: predicted 6 twice (0.9, 0.5) and 7 once (0.8); after (4, 5): 6 once
    table = ModelNgrams.from_predictions([
        ([4, 5], [0, 6], [0.1, 0.9]),
        ([3, 5], [0, 6], [0.1, 0.5]),
        ([2, 5], [0, 7], [0.1, 0.8]),
    ], min_confidence=0.3)
    token, confidence = table.entries[(5,)]
    assert token == 6 and confidence == pytest.approx((0.9 + 0.5) / 3)  # the mean over every occurrence
    assert table.entries[(4, 5)] == (6, 0.9) and table.entries[(2, 5)] == (7, 0.8)
    assert (4,) not in table.entries and (2,) not in table.entries  # predicted with 0.1: below the bar


def test_contexts_are_at_most_context_tokens_long():
    table = ModelNgrams.from_predictions([([1, 2, 3, 4, 5], [9, 9, 9, 9, 9], [0.9] * 5)], context_tokens=3)
    assert max(len(context) for context in table.entries) == 3
    assert (3, 4, 5) in table.entries and (2, 3, 4, 5) not in table.entries


def test_the_guess_follows_the_longest_context_known_and_chains():
    table = ModelNgrams({
        (1,): (2, 0.5), (7, 1): (3, 0.95),  # after 7 1 the longer context wins
        (1, 3): (4, 0.8), (4,): (5, 0.6),  # then 1 3 -> 4, then 4 alone (no longer context known) -> 5
    })
    assert table.guess([6, 7, 1]) == ([3, 4, 5], 0.95)
    assert table.guess([6, 8, 1]) == ([2], 0.5)  # after 8 1 only 1 is known; nothing after 1 2 or 2
    assert table.guess([6, 7, 1], max_tokens=2) == ([3, 4], 0.95)
    assert table.guess([9]) == ([], 0.0)


def test_the_bound_keeps_the_surest_entries():
    table = ModelNgrams.from_predictions([([1, 2, 3], [4, 5, 6], [0.5, 0.9, 0.7])], context_tokens=1,
                                         max_bytes=2 * BYTES_PER_ENTRY)
    assert table.entries == {(2,): (5, 0.9), (3,): (6, 0.7)} and table.num_bytes == 2 * BYTES_PER_ENTRY


def test_the_table_round_trips_through_json():
    table = ModelNgrams({(1,): (2, 0.5), (7, 1): (3, 0.95)})
    assert ModelNgrams.from_json(table.to_json()).entries == table.entries


def test_kinds_are_tenths_of_the_first_confidence():
    assert kind(0.34) == "model:conf3" and kind(0.999) == "model:conf9" and kind(1.0) == "model:conf9"


def test_spectra_drafts_the_tables_guess_after_the_core_and_prices_it_by_its_kind():
    drafter = SpectraDrafter(pool_size=0, model_ngrams=ModelNgrams({(8,): (9, 0.85), (9,): (10, 0.7)}))
    assert drafter.name == "spectra"  # the table is calibrated retrieval, not the core
    index = drafter.new_index()
    index.extend([5, 8, 11])  # the backward dictionary guesses 11 after 5 8
    guesses = drafter.guesses(index, [5, 8])
    assert [(g.token_ids, g.kind) for g in guesses] == [([11], "backward:context2"), ([9, 10], "model:conf8")]
    assert drafter.state_bytes() >= 2 * BYTES_PER_ENTRY


def test_a_resting_request_drafts_the_tables_guess_alone_scored_by_its_kind(monkeypatch):
    from drafters.spectra import NgramDictionaries

    drafter = SpectraDrafter(pool_size=0, model_ngrams=ModelNgrams({(8,): (9, 0.95), (9,): (10, 0.7)}))
    req = SimpleNamespace(request_id="r", all_token_ids=[5, 8, 11, 5, 8])  # the backward dictionary would guess 11
    drafter.begin(req)
    monkeypatch.setattr(NgramDictionaries, "extend", lambda self, token_ids: pytest.fail("no catching up"))
    (draft,) = drafter.propose_resting([req])
    assert draft.token_ids == [9, 10] and draft.parents == [-1, 0]
    assert draft.acceptance == [drafter.rates.rate("model:conf9", 1), drafter.rates.rate("model:conf9", 2)]
    drafter.extend(req, [9])
    assert drafter.rates.counts("model:conf9", 1) == (1, 1) and drafter.rates.counts("model:conf9", 2) == (0, 0)
    core = SpectraDrafter(pool_size=0)
    core.begin(req)
    assert [len(d) for d in core.propose_resting([req])] == [0]  # spectra-core has no such guess
