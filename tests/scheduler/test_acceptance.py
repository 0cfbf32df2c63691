"""Acceptance estimates per drafter, depth and sibling rank, learnt only from nodes that were actually tried."""
import pytest

from drafters.base import Draft
from engine.wire import SamplingParams
from scheduler.acceptance import CalibratedEstimator, TreeAcceptance, scored_nodes, tried_nodes
from scheduler.request import Request

TREE = Draft([10, 11, 12, 20, 21, 30], "ngram", [-1, 0, 1, -1, 3, -1])  # three rows: 10-11-12, 20-21, 30


def make_request(request_id="r"):
    return Request(request_id, [1, 2, 3], SamplingParams(temperature=0.0))


def test_prior_before_any_observation():
    estimator = TreeAcceptance(prior=0.5, prior_weight=4.0)
    assert estimator.estimate(make_request(), TREE) == pytest.approx([0.5] * 6)


def test_nodes_are_scored_against_the_targets_tokens_along_its_path():
    # the target produced 20 21 99: at depth 1 every root child is scored (20 matches node 3), at depth 2 the
    # children of node 3 (21 matches node 4), at depth 3 node 4 has no children; node 1 under 10 is never scored
    assert scored_nodes(TREE, [20, 21, 99]) == [
        ((1, 0), False), ((1, 1), True), ((1, 2), False), ((2, 0), True),
    ]
    assert scored_nodes(TREE, [30]) == [((1, 0), False), ((1, 1), False), ((1, 2), True)]  # a bare last token
    assert scored_nodes(TREE, [7]) == [((1, 0), False), ((1, 1), False), ((1, 2), False)]


def test_ranks_learn_separately_and_deeper_nodes_inherit_from_the_level_above():
    estimator = TreeAcceptance(prior=0.5, prior_weight=4.0)
    req = make_request()
    for _ in range(40):  # the step produced 10 and 11: the first row's two first tokens, depth 3 never reached
        estimator.observe(req, TREE, [10, 11])
    rates = estimator.estimate(make_request("other"), TREE)  # other requests share the drafter's statistics
    assert rates[0] > 0.9 and rates[1] > 0.9  # depth 1 and 2, rank 0
    assert rates[2] > 0.85  # depth 3 was never scored: it inherits depth 2's rate
    assert rates[3] < 0.1 and rates[5] < 0.1  # ranks 1 and 2 at depth 1: always rejected
    assert rates[4] == rates[1]  # keyed by its own depth and rank (2, 0), like node 1: conditional on its parent...
    assert rates[3] * rates[4] < 0.1  # ...so its path, through a rejected-every-time parent, is unlikely


def test_a_drafters_own_estimates_are_used_as_they_are():
    estimator = TreeAcceptance(prior=0.5, prior_weight=4.0)
    draft = Draft([1, 2], "model", acceptance=[0.9, 0.3])
    assert estimator.estimate(make_request(), draft) == [0.9, 0.3]


def test_a_requests_own_history_counts_and_is_forgotten_when_it_ends():
    estimator = TreeAcceptance(prior=0.5, prior_weight=1.0)
    req = make_request()
    estimator.observe(req, Draft([1], "copyspec"), [2])
    assert estimator.by_request["r"]["copyspec"].tried == {(1, 0): 1}
    estimator.forget("r")
    assert "r" not in estimator.by_request and estimator.by_drafter["copyspec"].tried == {(1, 0): 1}


def test_a_requests_history_of_one_drafter_does_not_lower_its_estimates_for_another():
    # copy first, model second: the model's drafts for a request are rejected, its copies accepted
    estimator = TreeAcceptance(prior=0.5, prior_weight=4.0)
    req = make_request()
    for _ in range(20):
        estimator.observe(req, Draft([1], "draft"), [2])
        estimator.observe(req, Draft([3], "copyspec"), [3])
    estimator.by_drafter.clear()  # only the request's own history is left
    assert estimator.estimate(req, Draft([3], "copyspec"))[0] > 0.8
    assert estimator.estimate(req, Draft([1], "draft"))[0] < 0.2


def sampled_request(request_id="s"):
    return Request(request_id, [1, 2, 3], SamplingParams(temperature=1.0))


def test_calibration_starts_at_one_and_follows_what_the_verified_tokens_accept():
    """Forty verified root children estimated at 0.4 (the drafter's own estimates), ten accepted."""
    estimator = CalibratedEstimator(TreeAcceptance(prior=0.5, prior_weight=4.0))
    req, draft = sampled_request(), Draft([7, 8], "spectra", acceptance=[0.4, 0.0])
    assert estimator.estimate(req, draft) == [0.4, 0.0]
    for hit in [False] * 30 + [True] * 10:
        estimator.observe_verified(req, draft, [0], [-1], [0] if hit else [])
    factor = estimator.factor("spectra", True)
    assert 10 / 16 < factor < 1.0  # the prior of 1 still counts a little
    assert estimator.estimate(req, draft) == pytest.approx([0.4 * factor, 0.0])
    assert estimator.estimate(make_request(), draft) == [0.4, 0.0]  # greedy decoding is calibrated apart
    assert estimator.factor("copyspec", True) == 1.0  # and so is every drafter
    assert estimator.factors() == {"spectra": {"sampled": pytest.approx(factor)}}


def test_calibration_forgets_old_tokens_and_never_raises_an_estimate_past_099():
    estimator = CalibratedEstimator(TreeAcceptance(prior=0.5, prior_weight=4.0))
    req, draft = make_request(), Draft([7, 8], "ngram", acceptance=[0.5, 0.5])
    for accepted in ([], [0, 1]):  # the root child rejected 4000 times, then the chain accepted whole 4000 times
        for _ in range(4000):
            estimator.observe_verified(req, draft, [0, 1], [-1, 0], accepted)
    factor = estimator.factor("ngram", False)
    assert factor > 1.5  # the latest tokens outweigh the old ones
    high = Draft([7, 8, 9], "ngram", acceptance=[0.9, 0.995, 0.2])
    assert estimator.estimate(req, high) == pytest.approx([0.99, 0.995, 0.2 * factor])


def test_tried_nodes_are_the_verified_ones_whose_parent_was_accepted():
    # selection: 0 (root child) -> 1 -> 2, and 3 (root child) -> 4; accepted 0 then 1: node 2 tried and missed,
    # 3 tried (a root child) and missed, 4 never tried (its parent missed)
    assert tried_nodes([-1, 0, 1, -1, 3], [0, 1]) == [(0, True), (1, True), (2, False), (3, False)]
    assert tried_nodes([-1, 0], []) == [(0, False)]
