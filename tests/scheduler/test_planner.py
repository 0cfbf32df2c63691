import pytest

from scheduler.latency import LatencyModel
from scheduler.planner import best_num_draft_tokens, expected_tokens

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
