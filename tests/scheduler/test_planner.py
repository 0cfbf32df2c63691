import pytest

from scheduler.latency import LatencyModel
from scheduler.planner import _greedy_order, best_num_draft_tokens, expected_tokens, plan_verification

CPU_LIKE = LatencyModel({1: 0.069, 2: 0.072, 4: 0.080, 11: 0.134, 16: 0.150})  # seconds, the CPU figures


def test_expected_tokens_multiplies_conditional_acceptance():
    assert expected_tokens([]) == [1.0]
    assert expected_tokens([0.5, 0.5]) == pytest.approx([1.0, 1.5, 1.75])


@pytest.mark.parametrize(
    "acceptance, expected_k",
    [
        ([0.0] * 10, 0),  # nothing will be accepted: plain decoding
        ([0.02] * 10, 0),  # verifying costs more than it yields
        ([0.99] * 10, 10),  # near-certain copies: verify them all
        ([0.9, 0.9, 0.05, 0.9, 0.9], 2),  # stop before the position that will likely fail
    ],
)
def test_best_num_draft_tokens(acceptance, expected_k):
    assert best_num_draft_tokens(acceptance, CPU_LIKE) == expected_k


def test_latency_model_interpolates_and_never_decreases():
    model = LatencyModel({1: 1.0, 3: 3.0, 5: 2.0})  # a noisy profile where 5 looked cheaper than 3
    assert model(2) == pytest.approx(2.0)
    assert model(4) == pytest.approx(3.0)
    assert model(0) == 1.0
    assert model(7) >= model(5)
    with pytest.raises(ValueError):
        LatencyModel({})


def test_batch_plan_takes_the_best_tokens_from_any_request():
    latency = LatencyModel({1: 1.0, 4: 1.0, 8: 2.0})  # 4 tokens cost the same as 1; 8 cost double
    plan = plan_verification([[0.9, 0.9, 0.9], [0.1, 0.1], [0.95]], num_base_tokens=3, num_base_expected=3.0, latency=latency)
    assert plan == [0, 0, 1]  # one free slot: the most likely token wins


def test_batch_plan_verifies_everything_when_the_forward_is_flat_and_nothing_when_steep():
    acceptance = [[0.6, 0.5], [0.7]]
    flat = LatencyModel({1: 1.0, 100: 1.0})
    steep = LatencyModel({1: 1.0, 2: 2.0, 100: 100.0})
    assert plan_verification(acceptance, 2, 2.0, flat) == [2, 1]
    assert plan_verification(acceptance, 2, 2.0, steep) == [0, 0]


def test_greedy_order_keeps_order_within_a_request():
    order = _greedy_order([[0.2, 0.99, 0.99], [0.5]])
    assert [request for _, request in order] == [1, 0, 0, 0]
    assert [gain for gain, _ in order] == pytest.approx([0.5, 0.2, 0.198, 0.19602])


def test_single_request_plan_is_the_batch_plan_of_one():
    latency = LatencyModel({1: 0.069, 2: 0.072, 11: 0.134})
    acceptance = [0.8, 0.7, 0.6, 0.2]
    assert best_num_draft_tokens(acceptance, latency) == plan_verification([acceptance], 1, 1.0, latency)[0]
