"""PLD+ ranks the earlier occurrences of the last token by the target's own hidden states or attention; on sequences
built so that only that ranking finds the right source, it copies from there and plain lookup does not."""
from dataclasses import dataclass, field

import torch

from drafters.base import Computed
from drafters.pld import NgramPositions
from drafters.pld_plus import PldPlusDrafter, PldPlusState

# Token 5 occurs three times before the last token (also 5). After 5 come 10 11, 20 21 and 30 31. The token before
# each occurrence is the same (4), so suffix matching cannot tell them apart; the hidden states can.
TOKENS = [4, 5, 10, 11, 4, 5, 20, 21, 4, 5, 30, 31, 9, 4, 5]
SOURCE = 5  # the occurrence whose context resembles the last one's (position 4 precedes it)


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)


def hidden_states(num_positions: int, like: dict[int, int]) -> torch.Tensor:
    """Random directions, except position a copies position b's for each a: b in LIKE."""
    states = torch.randn(num_positions, 8, generator=torch.Generator().manual_seed(0))
    for a, b in like.items():
        states[a] = states[b] * 3.0  # same direction, other length: cosine 1
    return states


def test_the_hidden_state_ranking_picks_the_occurrence_whose_context_matches():
    drafter = PldPlusDrafter("hidden", max_tokens=2, layer=1)
    req = Req("r", list(TOKENS))
    drafter.begin(req)
    # the last token (position 14) was produced at position 13; position SOURCE - 1 = 4 has the same hidden state
    drafter.observe(req, Computed(0, TOKENS[:-1], hidden_states=hidden_states(len(TOKENS) - 1, {13: SOURCE - 1})))
    assert drafter.propose([req])[0].token_ids == [20, 21]
    plain = NgramPositions()
    plain.extend(TOKENS)
    assert plain.first_continuation(TOKENS, 2) == [10, 11]  # plain lookup copies after the first occurrence


def test_the_attention_ranking_picks_the_occurrence_the_heads_attend_to():
    drafter = PldPlusDrafter("attention", max_tokens=2, heads=((0, 1), (1, 2)))
    req = Req("r", list(TOKENS))
    drafter.begin(req)
    attention = torch.full((2, len(TOKENS) - 1), 0.01)
    attention[1, 9] = 0.9  # one head points at the third occurrence (position 9)
    drafter.observe(req, Computed(0, TOKENS[:-1], attention=attention))
    assert drafter.propose([req])[0].token_ids == [30, 31]


def test_nothing_matches_no_draft_and_a_choice_that_differs_is_scored():
    drafter = PldPlusDrafter("hidden", max_tokens=3, layer=1)
    req = Req("r", [1, 2, 3, 7])
    drafter.begin(req)
    drafter.observe(req, Computed(0, [1, 2, 3], hidden_states=torch.randn(3, 8)))
    assert len(drafter.propose([req])[0]) == 0
    req = Req("s", list(TOKENS))
    drafter.begin(req)
    drafter.observe(req, Computed(0, TOKENS[:-1], hidden_states=hidden_states(len(TOKENS) - 1, {13: SOURCE - 1})))
    drafter.propose([req])
    drafter.extend(req, [20])
    assert drafter.stats == {"drafts": 1, "differs_from_first_match": 1, "ranked_right": 1, "first_match_right": 0}


def test_state_memory_is_counted_and_a_next_turn_keeps_what_it_shares_with_the_history():
    drafter = PldPlusDrafter("hidden", max_tokens=2, layer=1)
    req = Req("t1", [1, 2, 3, 4])
    drafter.begin(req)
    drafter.observe(req, Computed(0, [1, 2, 3], hidden_states=torch.randn(3, 8)))
    assert drafter.state_bytes() > 0
    state = drafter.finish(req)
    assert drafter.state_bytes() == 0 and state.num_bytes > 0
    edited = Req("t2", [1, 2, 9, 9, 9])  # parts from the history after two tokens
    drafter.begin(edited, state)
    assert state.token_ids == [1, 2, 9, 9, 9] and state.has_hidden[:3].tolist() == [True, True, False]


def test_a_state_stores_unit_vectors_and_grows():
    state = PldPlusState()
    state.store_hidden(0, torch.full((300, 4), 2.0))
    assert (state.hidden.shape[0] >= 300
            and torch.allclose(state.hidden[299].float().norm(), torch.tensor(1.0), atol=1e-3))
