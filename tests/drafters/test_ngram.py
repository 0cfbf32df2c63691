"""Learning-free n-grams: context windows counted and ranked, the model bigram filling the rows left, one tree."""
from dataclasses import dataclass, field

import pytest
import torch

from drafters.bigram import TABLE_TOP_K, BackgroundTable, BigramTable, build_bigram_table, load_table, table_path
from drafters.ngram import ROW_PRIOR, ROW_PRIOR_WEIGHT, ContextNgramIndex, NgramDrafter, RowRates, context_kind
from drafters.tree import depths


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)


def test_every_full_window_is_counted_and_ranked_by_count_then_recency():
    index = ContextNgramIndex(w=2)
    tokens = [5, 1, 2, 5, 3, 4, 5, 1, 2, 5, 3, 9, 5, 7, 7, 5]
    index.extend(tokens[:7])
    index.extend(tokens)  # incremental: only the windows the new tokens complete
    # windows starting with 5: (1,2) twice, (3,4) once, (3,9) once (later), (7,7) once (latest);
    # 5 at the end has no window
    assert index.top(tokens, 10) == [[1, 2], [7, 7], [3, 9], [3, 4]]
    assert index.top(tokens, 2) == [[1, 2], [7, 7]]
    assert index.top([8], 3) == []


def test_incremental_and_one_shot_indexing_agree():
    tokens = [(i * 7) % 11 for i in range(60)]
    one_shot, step_by_step = ContextNgramIndex(w=3), ContextNgramIndex(w=3)
    one_shot.extend(tokens)
    for end in range(1, len(tokens) + 1):
        step_by_step.extend(tokens[:end])
    assert one_shot.windows == step_by_step.windows


def table_of(rows: dict[int, list[int]], vocab=40) -> BigramTable:
    """A bigram table whose token x continues with rows[x] (padded), others with x + 1."""
    top = torch.zeros(vocab, TABLE_TOP_K, dtype=torch.int32)
    for token in range(vocab):
        ranked = rows.get(token, [(token + 1) % vocab])
        ranked = ranked + [t for t in range(vocab) if t not in ranked]
        top[token] = torch.tensor(ranked[:TABLE_TOP_K])
    return BigramTable(top)


class ReadyTable(BackgroundTable):
    def __init__(self, table):
        self.table, self.thread, self.path = table, None, None


def test_context_rows_come_first_and_bigram_rows_fill_the_rest_without_repeating_one():
    table = table_of({5: [1, 8, 9]})  # after 5: 1, 8, 9; each extended by its argmax (x + 1)
    drafter = NgramDrafter(k=3, w=2, bigram=ReadyTable(table))
    req = Req("r", [5, 1, 2, 4, 5])
    drafter.begin(req)
    draft = drafter.propose([req])[0]
    # context: 5 -> (1, 2). bigram rows: (1, 2) repeats it and is dropped; then (8, 9) and (9, 10)
    assert draft.token_ids == [1, 2, 8, 9, 9, 10] and draft.parents == [-1, 0, -1, 2, -1, 4]
    assert max(depths(draft.parents)) == 2 and draft.source == "ngram"


def test_without_a_table_yet_the_drafter_drafts_from_the_context_alone():
    drafter = NgramDrafter(k=10, w=3, bigram=None)
    req = Req("r", [1, 2, 3, 4, 1])
    drafter.begin(req)
    assert drafter.propose([req])[0].token_ids == [2, 3, 4]
    req.all_token_ids.append(9)
    drafter.extend(req, [9])
    assert len(drafter.propose([req])[0]) == 0  # nothing after 9, and no table: no draft at all


def test_a_next_turn_resumes_the_context_index():
    drafter = NgramDrafter(k=4, w=2, bigram=None)
    req = Req("t1", [7, 8, 9])
    drafter.begin(req)
    req.all_token_ids += [7, 8]
    drafter.extend(req, [7, 8])
    state = drafter.finish(req)
    turn2 = Req("t2", [7, 8, 9, 7, 8, 1, 7])
    drafter.begin(turn2, state)
    # 7 -> (8, 1), the more recent of two windows seen once each, then (8, 9): one shared first token
    assert drafter.propose([turn2])[0].token_ids == [8, 1, 9]
    assert drafter._corpora["t2"].index is state.index


def test_the_table_holds_each_tokens_top_next_tokens_of_a_bare_forward_and_is_cached(tmp_path):
    vocab = 40
    weights = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
    calls = []

    def next_token_logits(tokens):
        calls.append(len(tokens))
        return weights[tokens]

    table = build_bigram_table(next_token_logits, vocab)
    assert table.top_ids.shape == (vocab, TABLE_TOP_K)
    assert table.top_ids[3].tolist() == torch.topk(weights[3], TABLE_TOP_K).indices.tolist()
    assert table.rows(3, 2, 3)[1][:2] == [
        int(weights[3].topk(2).indices[1]),
        int(weights[int(weights[3].topk(2).indices[1])].argmax()),
    ]
    path = table_path(tmp_path, "abc")
    background = BackgroundTable(path, lambda: build_bigram_table(next_token_logits, vocab))
    assert background.wait(30) is not None and path.is_file()
    assert torch.equal(load_table(path).top_ids, background.table.top_ids)
    calls.clear()
    again = BackgroundTable(path, lambda: build_bigram_table(next_token_logits, vocab))
    assert again.table is not None and again.thread is None and calls == []  # from the cache: nothing recomputed


def test_a_failed_build_leaves_context_drafts_and_serving_goes_on(tmp_path):
    def broken():
        raise RuntimeError("out of memory")

    background = BackgroundTable(table_path(tmp_path, "x"), broken)
    assert background.wait(30) is None


def test_a_context_rows_kind_says_its_count_and_how_many_tokens_before_it_agree():
    tokens = [4, 5, 6, 1, 2, 3, 9, 4, 5, 6, 1]  # the query 1 is preceded by 4 5 6, as the window at 3 is
    assert context_kind(tokens, 1, 3) == "context:count1:match3"
    assert context_kind([7, 1, 2, 3, 8, 1], 2, 1) == "context:count2+:match0"
    assert context_kind([1, 2, 3, 8, 1], 1, 0) == "context:count1:match0"  # nothing before the window


def test_row_rates_score_every_row_against_the_targets_tokens_down_to_its_first_miss():
    rates = RowRates()
    rows = [([5, 6, 7], "a"), ([5, 6, 9], "b"), ([8, 1, 1], "c")]
    rates.score(rows, [5, 6, 9, 4])  # the target's tokens: rows a and b share two, b's third is right too
    assert rates.counts("a", 3) == (1, 0) and rates.counts("b", 3) == (1, 1) and rates.counts("c", 1) == (1, 0)
    assert rates.counts("c", 2) == (0, 0)  # never scored past its first miss
    for _ in range(50):
        rates.score(rows, [5, 6, 9, 4])
    assert rates.rate("b", 3) > 0.9 and rates.rate("c", 1) < 0.1
    assert rates.rate("b", 4) > 0.85  # depth 4 never scored: it inherits depth 3


def test_a_rows_rates_shrink_each_depth_towards_the_one_before():
    rates = RowRates()
    rates.score([([5, 6], "a")], [5, 7])  # depth 1 right, depth 2 wrong
    first = (1 + ROW_PRIOR * ROW_PRIOR_WEIGHT) / (1 + ROW_PRIOR_WEIGHT)
    second = (0 + first * ROW_PRIOR_WEIGHT) / (1 + ROW_PRIOR_WEIGHT)
    assert rates.rates("a", 3) == pytest.approx([first, second, second])  # depth 3 unscored: depth 2's rate
    assert rates.rate("a", 2) == pytest.approx(second)


def test_estimates_give_each_key_its_kinds_rate_at_its_depth():
    own, shared = RowRates(), RowRates()
    shared.score([([5, 6, 7], "a"), ([5, 8], "b")], [5, 6, 9])
    own.score([([5, 6], "a")], [5, 7])
    keys = [("a", 3), ("b", 1), ("a", 1), ("c", 2), ("a", 3)]
    expected = [own.rate(kind, depth, shared=shared) for kind, depth in keys]
    assert own.estimates(keys, shared=shared) == pytest.approx(expected)
    assert len(set(expected)) == 4  # the keys' rates differ: a wrong depth or kind would show


def test_each_tree_token_carries_the_best_estimate_of_the_rows_through_it():
    drafter = NgramDrafter(k=3, w=2, bigram=ReadyTable(table_of({5: [1, 8, 9]})))
    req = Req("r", [5, 1, 2, 4, 5])
    drafter.begin(req)
    for _ in range(30):  # the context row (1, 2) keeps being right; the bigram rows never
        draft = drafter.propose([req])[0]
        drafter.rates.score(drafter._proposed.pop("r"), [1, 2, 7])
    draft = drafter.propose([req])[0]
    assert draft.token_ids[:2] == [1, 2] and draft.acceptance[0] > 0.9 and draft.acceptance[1] > 0.9
    assert all(rate < 0.15 for rate in draft.acceptance[2:])


def test_extend_scores_the_last_draft_with_the_steps_tokens():
    drafter = NgramDrafter(k=2, w=2, bigram=None)
    req = Req("r", [3, 4, 5, 3])
    drafter.begin(req)
    assert drafter.propose([req])[0].token_ids == [4, 5]
    req.all_token_ids += [4, 6]
    drafter.extend(req, [4, 6])  # 4 accepted, then the target said 6
    kind = "context:count1:match0"
    assert drafter.rates.counts(kind, 1) == (1, 1) and drafter.rates.counts(kind, 2) == (1, 0)
