"""SPECTRA-core: the forward and backward dictionaries as Algorithm 1 updates them, the bidirectional search with the
backward guess first, at most G guesses merged into one tree, and the dictionaries carried across a session's turns."""
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from drafters.base import Computed
from drafters.spectra import NgramDictionaries, SpectraDrafter
from drafters.tree import path_to


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)


def indexed(tokens, n=5, cap=15) -> NgramDictionaries:
    index = NgramDictionaries(n, cap)
    index.extend(tokens)
    return index


def guesses_of(index, token):
    return [guess for guess, _ in index.forward_guesses(token)]


def test_a_chain_updates_both_dictionaries_as_algorithm_1_does():
    index = NgramDictionaries(n=4)
    index.add_chain([1, 2, 3, 4])
    assert {token: list(listed) for token, listed in index.forward.items()} == {1: [(2, 3, 4)], 2: [(3, 4)], 3: [(4,)]}
    assert index.backward == {(1,): 2, (1, 2): 3, (1, 2, 3): 4}


def test_the_token_list_feeds_every_window_and_the_latest_write_wins_backward():
    index = indexed([1, 2, 3, 1, 2, 4], n=3)
    assert index.backward[(1, 2)] == 4 and index.backward[(2,)] == 4 and index.backward[(3, 1)] == 2
    assert guesses_of(index, 1) == [[2, 4], [2, 3]]  # most recent first
    assert guesses_of(index, 2) == [[4], [3, 1]]


def test_a_continuation_that_a_longer_one_extends_is_not_listed_twice():
    index = indexed([7, 8, 9, 5, 6], n=5)
    assert guesses_of(index, 7) == [[8, 9, 5, 6]]  # its shorter prefixes, written on the way, were replaced
    index.add_chain([7, 8])  # a prefix of the listed continuation only refreshes it
    assert guesses_of(index, 7) == [[8, 9, 5, 6]]


def test_each_tokens_list_keeps_its_most_recent_continuations():
    tokens = []
    for follower in range(10, 30):
        tokens += [1, follower]
    index = indexed(tokens, n=2, cap=4)
    assert guesses_of(index, 1) == [[29], [28], [27], [26]]


def test_no_listed_continuation_is_a_prefix_of_another_whatever_the_order_of_writes():
    """The forward dictionary's updates rely on it: a continuation and one a token shorter are never both listed."""
    rng = random.Random(1)
    index = NgramDictionaries(per_key_cap=4)
    tokens = []
    for _ in range(400):
        if rng.random() < 0.3:
            index.add_chain([rng.randrange(5) for _ in range(rng.randint(1, 5))], from_pool=True)
        else:
            tokens.append(rng.randrange(5))
            index.extend(tokens)
    for listed in index.forward.values():
        assert len(listed) <= 4
        assert not any(a != b and b[:len(a)] == a for a in listed for b in listed)
    assert index.num_continuations == sum(len(listed) for listed in index.forward.values())
    assert all(continuation in index.forward[token] for token, continuation in index.pool_forward)


def test_incremental_and_one_shot_indexing_agree():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    incremental = NgramDictionaries()
    for end in range(0, len(tokens) + 1, 7):
        incremental.extend(tokens[:end])
    incremental.extend(tokens)
    one_shot = indexed(tokens)
    assert incremental.backward == one_shot.backward and incremental.num_bytes == one_shot.num_bytes > 0
    assert one_shot.num_continuations == sum(len(listed) for listed in one_shot.forward.values())
    assert {k: list(v) for k, v in incremental.forward.items()} == {k: list(v) for k, v in one_shot.forward.items()}


def test_the_backward_guess_follows_the_longest_known_context_token_by_token():
    index = NgramDictionaries(n=3)
    index.add_chain([5, 1, 2])  # after (5, 1): 2
    index.add_chain([9, 1, 7])  # after (9, 1): 7, and after (9,): 1
    index.add_chain([1, 3])  # after (1,): 3, the latest
    index.add_chain([7, 9])
    # context ... 9, 1: the 2-token context (9, 1) says 7 (not (1,) -> 3); then (1, 7) is unknown, (7,) says 9; ...
    assert index.backward_guess([4, 9, 1], max_tokens=4) == ([7, 9, 1, 7], False, 2)  # the first after 2 tokens
    assert index.backward_guess([4, 6], max_tokens=4) == ([], False, 0)  # nothing known after 6


def test_the_backward_guess_runs_past_n_while_the_dictionary_knows_the_next_token():
    drafter = SpectraDrafter(n=3, pool_size=0, backward_tokens=7)
    tokens = [5, 1, 2, 3, 4, 1, 2]
    req = Req("r", tokens)
    drafter.begin(req)
    guess = drafter.guesses(drafter._corpora["r"].index, tokens)[0]
    # after (1, 2) comes 3, then 4, 1, 2, 3, ... as the list repeats itself, cut at 7 tokens
    assert guess.token_ids == [3, 4, 1, 2, 3, 4, 1] and guess.kind == "backward:context2"
    drafter = SpectraDrafter(n=3, pool_size=0, backward_tokens=7)
    tokens = [5, 1, 2, 3, 9]
    drafter.begin(Req("s", tokens))
    assert drafter.backward_tokens == 7 and drafter.guesses(drafter._corpora["s"].index, [1, 2])[0].token_ids == [3, 9]


def test_guesses_put_the_backward_one_first_cap_at_g_and_merge_into_one_tree():
    drafter = SpectraDrafter(n=3, max_guesses=3, pool_size=0, backward_tokens=3)
    tokens = [1, 2, 3, 0, 1, 2, 4, 0, 1, 5, 6, 0, 1, 7, 8, 0, 1]
    req = Req("r", tokens)
    drafter.begin(req)
    index = drafter._corpora["r"].index
    guesses = drafter.guesses(index, tokens)
    assert index.backward_guess(tokens, 3) == ([7, 8, 0], False, 2) and guesses[0].token_ids == [7, 8, 0]
    # forward rank 0 ([7, 8]) is covered by the backward guess
    assert [g.kind for g in guesses] == ["backward:context2", "forward:rank1", "forward:rank2"]
    assert [g.token_ids for g in guesses[1:]] == [[5, 6], [2, 4]]
    draft = drafter.propose([req])[0]
    assert draft.source == "spectra-core" and len(draft.acceptance) == len(draft) == 7 and draft.lookahead == ()
    paths = {tuple(draft.token_ids[node] for node in path_to(draft.parents, leaf)) for leaf in range(len(draft))
             if leaf not in draft.parents}
    assert paths == {(7, 8, 0), (5, 6), (2, 4)}


def test_the_model_bigram_adds_its_rows_after_the_other_guesses_leaving_out_covered_ones():
    """Up to bigram_guesses rows of N - 1 tokens after the last token, the target's own next tokens after it bare; a
    row that a guess taken already holds as a prefix adds nothing; no table (still building): no bigram guess."""
    from drafters.bigram import BigramTable

    top_ids = torch.tensor([[0, 1], [2, 3], [3, 2], [1, 0], [0, 0], [0, 0], [0, 0], [0, 0], [0, 0]], dtype=torch.int32)
    bigram = SimpleNamespace(table=BigramTable(top_ids))  # after 1: 2 then 3; argmax chain 2 -> 3 -> 1 -> 2
    drafter = SpectraDrafter(n=3, max_guesses=3, pool_size=0, backward_tokens=3, bigram=bigram, bigram_guesses=2)
    tokens = [5, 6, 7, 1]
    drafter.begin(Req("r", tokens))
    guesses = drafter.guesses(drafter._corpora["r"].index, tokens)
    assert [(g.kind, g.token_ids) for g in guesses] == [("bigram:rank0", [2, 3]), ("bigram:rank1", [3, 1])]
    tokens = [1, 2, 3, 0, 1]  # the backward guess [2, 3, 0] covers the bigram's first row [2, 3]
    drafter.begin(Req("s", tokens))
    guesses = drafter.guesses(drafter._corpora["s"].index, tokens)
    assert [(g.kind, g.token_ids) for g in guesses] == [("backward:context1", [2, 3, 0]), ("bigram:rank1", [3, 1])]
    drafter.bigram = SimpleNamespace(table=None)
    assert [g.kind for g in drafter.guesses(drafter._corpora["s"].index, tokens)] == ["backward:context1"]


@pytest.mark.parametrize("kept", ["backward", "forward"])
def test_drafting_from_one_dictionary_alone_leaves_out_the_others_guesses(kept):
    """The ablation's switch: both dictionaries still learn; guesses come from the one kept."""
    drafter = SpectraDrafter(n=3, max_guesses=3, pool_size=0, backward_tokens=3)
    drafter.dictionaries = frozenset({kept})
    tokens = [1, 2, 3, 0, 1, 2, 4, 0, 1, 5, 6, 0, 1, 7, 8, 0, 1]
    drafter.begin(Req("r", tokens))
    index = drafter._corpora["r"].index
    guesses = drafter.guesses(index, tokens)
    assert index.backward and index.forward
    if kept == "backward":
        assert [(g.kind, g.token_ids) for g in guesses] == [("backward:context2", [7, 8, 0])]
    else:
        assert [g.token_ids for g in guesses] == [[7, 8], [5, 6], [2, 4]]
        assert all(g.kind.startswith("forward") for g in guesses)


def test_the_steps_tokens_score_the_last_guesses_by_kind():
    drafter = SpectraDrafter(n=3, pool_size=0)
    req = Req("r", [1, 2, 3, 1])
    drafter.begin(req)
    drafter.propose([req])  # backward guess [2, 3, 1]
    req.all_token_ids.append(2)
    drafter.extend(req, [2])
    for rates in (drafter.rates, drafter._request_rates["r"]):  # every request's, and the request's own
        assert rates.counts("backward:context1", 1) == (1, 1) and rates.counts("backward:context1", 2) == (0, 0)


def test_tree_nodes_take_the_first_guess_kind_and_are_scored_apart_where_guesses_agree():
    from drafters.spectra import Guess, node_kinds
    from drafters.tree import merge_rows, scored_walk

    guesses = [Guess([5, 6, 7], "backward", False), Guess([5, 6, 8], "forward:rank1", False),
               Guess([9], "forward:rank2", False)]
    token_ids, parents, paths = merge_rows([g.token_ids for g in guesses])
    kinds = node_kinds(guesses, paths, len(token_ids))
    assert list(zip(token_ids, kinds)) == [(5, "backward:agreed"), (6, "backward:agreed"), (7, "backward"),
                                           (8, "forward:rank1"), (9, "forward:rank2")]
    drafter = SpectraDrafter(n=3, pool_size=0)
    # the target's tokens: 5 6 8, then 3
    drafter.rates.score_walk(scored_walk(token_ids, parents, [5, 6, 8, 3]), kinds)
    assert drafter.rates.scored() == {  # (kind, depth): (tried, hits)
        ("backward:agreed", 1): (1, 1), ("forward:rank2", 1): (1, 0), ("backward:agreed", 2): (1, 1),
        ("backward", 3): (1, 0), ("forward:rank1", 3): (1, 1)}


def test_a_requests_own_outcomes_rate_its_guesses_before_every_requests_do():
    from drafters.ngram import ROW_PRIOR, ROW_PRIOR_WEIGHT, RowRates

    drafter = SpectraDrafter(n=3, pool_size=0)
    right, wrong = Req("right", [1, 2, 3, 1]), Req("wrong", [1, 2, 3, 1])  # both guess 2 3 1 (backward) next
    for req in (right, wrong):
        drafter.begin(req)
    kind = "backward:context1"  # after 1: the 2 of 1 2 3
    for request_id, hits in (("right", 10), ("wrong", 0)):  # ten backward guesses each: all right, all wrong
        drafter._request_rates[request_id] = own = RowRates()
        for index in range(10):
            own.add(kind, 1, index < hits)
            drafter.rates.add(kind, 1, index < hits)
    over_both = (10 + ROW_PRIOR * ROW_PRIOR_WEIGHT) / (20 + ROW_PRIOR_WEIGHT)  # ~0.47
    assert drafter.rates.rate(kind, 1) == pytest.approx(over_both)
    first = {req.request_id: drafter.propose([req])[0].acceptance[0] for req in (right, wrong)}
    assert first["right"] > 0.8 and first["wrong"] < 0.2
    drafter.finish(right)
    assert "right" not in drafter._request_rates


def test_a_next_turn_resumes_the_dictionaries():
    drafter = SpectraDrafter(n=3, backward_tokens=3)
    first = Req("a", [4, 5, 6, 7])
    drafter.begin(first)
    state = drafter.finish(first)
    second = Req("b", [4, 5, 6, 7, 9, 4])
    drafter.begin(second, state)
    assert drafter._corpora["b"] is state and state.index.num_indexed == 6
    # after 4: the first turn's 4 5 6 7, backward token by token, and forward (a prefix of it, so left out)
    assert [(g.token_ids, g.kind) for g in drafter.guesses(state.index, second.all_token_ids)] == [
        ([5, 6, 7], "backward:context1")]


@pytest.mark.parametrize("n", [1, 0])
def test_n_below_two_is_refused(n):
    from drafters.config import SpecConfig

    with pytest.raises(ValueError, match="spectra_n"):
        SpecConfig(spectra_n=n)


def logits_preferring(vocab, *tokens):
    """[len(tokens), vocab] logits whose argmax in row i is tokens[i] and whose runner-up is tokens[i] + 1."""
    logits = torch.zeros(len(tokens), vocab)
    for row, token in enumerate(tokens):
        logits[row, token], logits[row, (token + 1) % vocab] = 2.0, 1.0
    return logits


def test_the_pool_offers_its_chains_as_look_ahead_and_advances_those_carried():
    drafter = SpectraDrafter(n=3, pool_size=3, tau=1.0)  # tau 1: always the most probable token
    req = Req("r", [1, 2, 3, 4, 5])
    drafter.begin(req)
    chains = drafter.propose([req])[0].lookahead
    assert len(chains) == 3 and all(len(chain) == 2 and set(chain) <= {1, 2, 3, 4, 5} for chain in chains)
    # the scheduler kept the first two chains: their next tokens are 7 and 8
    drafter.observe(req, Computed(4, [5], lookahead_logits=logits_preferring(10, 7, 8)))
    index = drafter._corpora["r"].index
    first, second = chains[0] + (7,), chains[1] + (8,)
    assert index.backward[first[:2]] == 7 and index.backward[second[:2]] == 8
    assert (first[0], first[1:]) in index.pool_forward and list(first[1:]) in guesses_of(index, first[0])
    # carried chains shift left and go to the back: the one left out is offered first next time
    assert drafter.propose([req])[0].lookahead == (chains[2], first[1:], second[1:])
    assert drafter.lookahead_yield.rows == 4


def test_past_tau_a_chain_takes_the_most_probable_token_the_forward_dictionary_lacks():
    drafter = SpectraDrafter(n=3, pool_size=1, tau=0.0)  # r > 0 always: refine
    req = Req("r", [1, 2, 7, 1, 2])  # 7 has a forward entry (7 -> 1 2), 8 none
    drafter.begin(req)
    assert 7 in drafter._corpora["r"].index.forward and 8 not in drafter._corpora["r"].index.forward
    chain = drafter.propose([req])[0].lookahead[0]
    drafter.observe(req, Computed(4, [2], lookahead_logits=logits_preferring(10, 7)))
    assert drafter._corpora["r"].index.backward[chain] == 8


def test_what_look_ahead_rows_earned_is_credited_per_row():
    drafter = SpectraDrafter(n=3, pool_size=1, tau=1.0)
    req = Req("r", [1, 2, 3, 4])
    drafter.begin(req)
    prior = drafter.lookahead_yield.per_row
    drafter._pools["r"].chains = [[4, 6]]
    drafter.propose([req])
    drafter.observe(req, Computed(3, [4], lookahead_logits=logits_preferring(10, 9)))  # the pool writes 4 6 9
    assert drafter.lookahead_yield.rows == 2 and drafter.lookahead_yield.per_row < prior  # nothing earned yet
    drafter.propose([req])
    guesses = drafter._proposed["r"].guesses
    # only the pool knows what follows
    assert [(g.token_ids, g.kind) for g in guesses] == [([6, 9], "backward:context1:pool")]
    drafter.extend(req, [6, 9])  # the target's tokens: both guessed tokens, and no other guess had them
    assert drafter.lookahead_yield.earned == 2
    assert drafter.lookahead_yield.per_row == (2 + prior * 64) / (2 + 64)


def test_finished_responses_feed_the_traffic_index_that_later_requests_draw_on():
    from drafters.retrieval import SuffixIndex

    drafter = SpectraDrafter(n=3, max_guesses=1, pool_size=0, backward_tokens=3, traffic=SuffixIndex(2**20))
    first = Req("a", [50, 51])
    drafter.begin(first)
    first.all_token_ids += [7, 8, 9, 10, 11, 12]  # its response
    drafter.finish(first)
    assert drafter.traffic.num_documents == 1 and drafter.state_bytes() == drafter.traffic.num_bytes > 0
    second = Req("b", [60, 1, 7, 8, 9, 1, 7, 8, 9])  # another conversation: its own 7 8 9 -> 1, and a's -> 10 11 12
    drafter.begin(second)
    guesses = drafter.guesses(drafter._corpora["b"].index, second.all_token_ids)
    # the core's G = 1 guess first, then retrieval's beyond G
    assert [(g.token_ids, g.kind) for g in guesses] == [
        ([1, 7, 8], "backward:context2"), ([10, 11, 12], "traffic:short")]
    assert drafter.propose([second])[0].source == "spectra"


def test_a_response_is_drafted_from_its_first_token_after_a_prompt_that_ends_like_an_earlier_one():
    from drafters.retrieval import SuffixIndex
    from drafters.spectra import LONG_RETRIEVAL_TOKENS, PROMPT_TAIL_TOKENS, RETRIEVAL_TOKENS

    drafter = SpectraDrafter(n=3, max_guesses=1, pool_size=0, traffic=SuffixIndex(2**20))
    asked = list(range(300, 300 + PROMPT_TAIL_TOKENS))  # the question and the chat template's assistant header
    response = list(range(200, 260))
    first = Req("a", [50, 51, *asked])
    drafter.begin(first)
    first.all_token_ids += response
    drafter.finish(first)
    other = Req("b", [70, 71, 72, *asked[-4:]])  # another prompt whose last tokens only are the same
    same = Req("c", [60, *asked])  # the same question in another conversation
    for req in (other, same):
        drafter.begin(req)
    retrieved = {req.request_id: [(g.token_ids, g.kind) for g in drafter.guesses(
        drafter._corpora[req.request_id].index, req.all_token_ids) if g.kind.startswith("traffic")]
        for req in (other, same)}
    assert retrieved["b"] == [(response[:RETRIEVAL_TOKENS], "traffic:short")]
    assert retrieved["c"] == [(response[:LONG_RETRIEVAL_TOKENS], "traffic:long")]


def test_a_long_match_drafts_further_than_a_short_one():
    from drafters.spectra import LONG_MATCH, LONG_RETRIEVAL_TOKENS, RETRIEVAL_TOKENS, retrieval_guess

    continuation = list(range(100, 100 + 2 * LONG_RETRIEVAL_TOKENS))
    short = retrieval_guess("traffic", continuation, LONG_MATCH - 1)
    long = retrieval_guess("corpus", continuation, LONG_MATCH)
    assert (short.token_ids, short.kind) == (continuation[:RETRIEVAL_TOKENS], "traffic:short")
    assert (long.token_ids, long.kind) == (continuation[:LONG_RETRIEVAL_TOKENS], "corpus:long")
    assert not short.from_pool and not long.from_pool


def test_a_response_repeated_after_a_long_match_is_drafted_past_the_short_bound():
    from drafters.retrieval import SuffixIndex
    from drafters.spectra import LONG_RETRIEVAL_TOKENS, RETRIEVAL_TOKENS

    drafter = SpectraDrafter(n=3, max_guesses=1, pool_size=0, traffic=SuffixIndex(2**20))
    first = Req("a", [50, 51])
    drafter.begin(first)
    response = list(range(200, 260))  # no token repeats: the core knows nothing of what follows
    first.all_token_ids += response
    drafter.finish(first)
    second = Req("b", [60, *response[:12]])  # another conversation re-emitting it, 12 tokens in
    drafter.begin(second)
    guesses = drafter.guesses(drafter._corpora["b"].index, second.all_token_ids)
    retrieved = [g for g in guesses if g.kind.startswith("traffic")]
    assert [(g.token_ids, g.kind) for g in retrieved] == [(response[12:12 + LONG_RETRIEVAL_TOKENS], "traffic:long")]
    assert LONG_RETRIEVAL_TOKENS > RETRIEVAL_TOKENS
