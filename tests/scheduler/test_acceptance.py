import pytest

from engine.wire import SamplingParams
from scheduler.acceptance import PositionalAcceptance
from scheduler.request import Request


def make_request(request_id="r"):
    req = Request(request_id, [1, 2, 3], SamplingParams(temperature=0.0))
    req.draft_source = "copyspec"
    return req


def test_prior_before_any_observation():
    estimator = PositionalAcceptance(prior=0.5, prior_weight=4.0)
    assert estimator.estimate(make_request(), 3) == pytest.approx([0.5, 0.5, 0.5])


def test_observations_move_the_estimate_and_unverified_positions_inherit():
    estimator = PositionalAcceptance(prior=0.5, prior_weight=4.0)
    req = make_request()
    for _ in range(20):
        estimator.observe(req, num_verified=2, num_accepted=2)
    rates = estimator.estimate(req, 4)
    assert rates[0] > 0.9 and rates[1] > 0.9
    assert rates[2] > 0.8 and rates[3] > 0.8  # never verified, but inherits from position 1
    other = make_request("other")
    assert estimator.estimate(other, 1)[0] > 0.8  # other requests share the drafter's statistics


def test_rejections_count_only_where_the_position_was_reached():
    estimator = PositionalAcceptance(prior=0.5, prior_weight=1.0)
    req = make_request()
    estimator.observe(req, num_verified=5, num_accepted=1)
    assert req.num_offered_by_position == [1, 1]  # position 2 onwards was never reached
    assert req.num_accepted_by_position == [1]
    assert estimator.num_offered["copyspec"] == [1, 1]
