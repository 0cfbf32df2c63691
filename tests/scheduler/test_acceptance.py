"""Acceptance estimates per drafter, depth and sibling rank, learnt only from nodes that were actually tried."""
import pytest

from drafters.base import Draft
from engine.wire import SamplingParams
from scheduler.acceptance import TreeAcceptance, tried_nodes
from scheduler.request import Request

TREE = Draft([10, 11, 12, 20, 21, 30], "ngram", [-1, 0, 1, -1, 3, -1])  # three rows: 10-11-12, 20-21, 30


def make_request(request_id="r"):
    return Request(request_id, [1, 2, 3], SamplingParams(temperature=0.0))


def test_prior_before_any_observation():
    estimator = TreeAcceptance(prior=0.5, prior_weight=4.0)
    assert estimator.estimate(make_request(), TREE) == pytest.approx([0.5] * 6)


def test_only_nodes_whose_parent_was_accepted_were_tried():
    # accepted path 3 -> 4 (the second row); node 5 (third row) was tried at the first level and rejected;
    # node 1 hangs under the rejected node 0, so it was never tried
    assert tried_nodes(TREE, verified=[0, 1, 3, 4, 5], accepted=[3, 4]) == [
        ((1, 0), False), ((1, 1), True), ((2, 0), True), ((1, 2), False),
    ]


def test_ranks_learn_separately_and_deeper_nodes_inherit_from_the_level_above():
    estimator = TreeAcceptance(prior=0.5, prior_weight=4.0)
    req = make_request()
    for _ in range(40):  # the first row's first token is always right, the others never
        estimator.observe(req, TREE, verified=[0, 1, 3, 5], accepted=[0, 1])
    rates = estimator.estimate(make_request("other"), TREE)  # other requests share the drafter's statistics
    assert rates[0] > 0.9 and rates[1] > 0.9  # depth 1 and 2, rank 0
    assert rates[2] > 0.85  # depth 3 was never verified: it inherits depth 2's rate
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
    estimator.observe(req, Draft([1], "copyspec"), verified=[0], accepted=[])
    assert estimator.by_request["r"].tried == {(1, 0): 1}
    estimator.forget("r")
    assert "r" not in estimator.by_request and estimator.by_drafter["copyspec"].tried == {(1, 0): 1}
