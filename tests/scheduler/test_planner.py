"""The goodput planner over draft trees: rooted subtrees chosen node by node, batch-wide, while goodput rises."""
import pytest

from scheduler.latency import LatencyModel
from scheduler.planner import (
    PlannedTree,
    expected_accepted,
    greedy_order,
    num_extra_paths,
    path_probabilities,
    plan_verification,
    prefill_worth,
)

CPU_LIKE = LatencyModel({1: 0.069, 2: 0.072, 4: 0.080, 11: 0.134, 16: 0.150})  # seconds, measured CPU figures


def chain(*rates):
    return PlannedTree(list(range(-1, len(rates) - 1)), list(rates))


def plan_one(tree, latency=CPU_LIKE):
    return plan_verification([tree], 1, 1.0, latency)[0]


def test_path_probability_multiplies_conditional_acceptance_along_the_path():
    tree = PlannedTree([-1, 0, -1, 2], [0.5, 0.5, 0.4, 1.0])
    assert path_probabilities(tree) == pytest.approx([0.5, 0.25, 0.4, 0.4])
    assert expected_accepted(tree, [0, 1, 2]) == pytest.approx(1.15)


@pytest.mark.parametrize(
    "rates, expected",
    [
        ([0.0] * 10, []),  # nothing will be accepted: plain decoding
        ([0.02] * 10, []),  # verifying costs more than it yields
        ([0.99] * 10, list(range(10))),  # near-certain copies: verify them all
        ([0.9, 0.9, 0.05, 0.9, 0.9], [0, 1]),  # stop before the position that will likely fail
    ],
)
def test_chains(rates, expected):
    assert plan_one(chain(*rates)) == expected


def test_a_tree_takes_the_likely_branch_deep_and_the_unlikely_sibling_not_at_all():
    # root children: 0 (0.9) and 3 (0.05); 0 -> 1 -> 2 at 0.9 each
    tree = PlannedTree([-1, 0, 1, -1], [0.9, 0.9, 0.9, 0.05])
    assert plan_one(tree) == [0, 1, 2]


def test_a_second_branch_is_worth_it_when_it_is_likely_and_the_forward_is_flat():
    tree = PlannedTree([-1, 0, -1, 2], [0.5, 0.9, 0.45, 0.9])
    flat = LatencyModel({1: 1.0, 100: 1.0})
    assert sorted(plan_one(tree, flat)) == [0, 1, 2, 3]


def test_greedy_order_is_by_path_probability_and_keeps_parents_first():
    trees = [PlannedTree([-1, 0, 0], [0.2, 0.99, 0.5]), chain(0.5)]
    order = greedy_order(trees)
    assert [(request, node) for _, request, node in order] == [(1, 0), (0, 0), (0, 1), (0, 2)]
    assert [gain for gain, _, _ in order] == pytest.approx([0.5, 0.2, 0.198, 0.1])


def test_batch_plan_takes_the_best_tokens_from_any_request():
    latency = LatencyModel({1: 1.0, 4: 1.0, 8: 2.0})  # 4 tokens cost the same as 1; 8 cost double
    plan = plan_verification([chain(0.9, 0.9, 0.9), chain(0.1, 0.1), chain(0.95)], 3, 3.0, latency)
    assert plan == [[], [], [0]]  # one free slot: the most likely token wins


def test_batch_plan_verifies_everything_when_the_forward_is_flat_and_nothing_when_steep():
    trees = [chain(0.6, 0.5), chain(0.7)]
    flat = LatencyModel({1: 1.0, 100: 1.0})
    steep = LatencyModel({1: 1.0, 2: 2.0, 100: 100.0})
    assert plan_verification(trees, 2, 2.0, flat) == [[0, 1], [0]]
    assert plan_verification(trees, 2, 2.0, steep) == [[], []]


def test_the_token_budget_caps_the_plan():
    flat = LatencyModel({1: 1.0, 100: 1.0})
    assert plan_verification([chain(0.9, 0.9, 0.9)], 1, 1.0, flat, max_draft_tokens=2) == [[0, 1]]


@pytest.mark.parametrize("parents, expected", [([], 0), ([-1, 0, 1], 0), ([-1, -1, 0, 0], 2), ([-1, 0, 0, 2, 2], 2)])
def test_extra_paths_are_the_leaves_beyond_the_first(parents, expected):
    assert num_extra_paths(parents) == expected


def test_a_branch_is_verified_only_when_its_gain_pays_for_the_context_its_path_reads_again():
    """Two branches off the root: the second opens a path, priced by path_seconds on top of the tokens' latency."""
    flat = LatencyModel({1: 0.1, 64: 0.1})  # tokens are free: only the path's price can stop the second branch
    tree = PlannedTree([-1, 0, -1, 2], [0.6, 0.9, 0.3, 0.9])
    assert sorted(plan_one(tree, flat)) == [0, 1, 2, 3]
    cheap, dear = (PlannedTree(tree.parents, tree.acceptance, path_seconds) for path_seconds in (0.001, 0.05))
    assert sorted(plan_one(cheap, flat)) == [0, 1, 2, 3]
    assert sorted(plan_one(dear, flat)) == [0, 1]  # 0.57 more tokens for 50% more time: not worth it


def test_prefill_chunks_count_as_what_their_seconds_would_yield_decoding():
    latency = LatencyModel({1: 1.0, 201: 61.0})  # 0.7 s + 0.3 s per token
    assert prefill_worth(2, 2, latency) == 0.0  # a plain decode step
    # 2 requests decode in 1.3 s; 100 more tokens add 30 s, worth 30 / 1.3 * 2 tokens
    assert prefill_worth(102, 2, latency) == pytest.approx(2 / 1.3 * 30.0)
    assert prefill_worth(100, 0, latency) == 0.0  # nothing decodes: no rate to count by
