import pytest
import torch
from scipy.stats import chisquare

from engine.sampler import target_probs, verify_greedy, verify_point_mass
from engine.wire import SamplingParams


def logits_for(rows):
    """rows of argmax ids -> [len, 5] logits with a clear winner in each row."""
    logits = torch.zeros(len(rows), 5)
    for i, winner in enumerate(rows):
        logits[i, winner] = 5.0
    return logits


@pytest.mark.parametrize(
    "argmax_rows, draft, expected",
    [
        ([3], [], [3]),  # no draft: plain greedy
        ([1, 2, 4], [1, 2], [1, 2, 4]),  # all accepted, then the bonus token
        ([1, 2, 4], [1, 3], [1, 2]),  # second rejected: the target's token replaces it
        ([0, 2, 4], [1, 2], [0]),  # first rejected
    ],
)
def test_verify_greedy(argmax_rows, draft, expected):
    assert verify_greedy(logits_for(argmax_rows), draft) == expected


def test_target_probs_applies_temperature_top_k_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    plain = target_probs(logits, SamplingParams(temperature=1.0))
    assert plain.sum().item() == pytest.approx(1.0)
    top_k = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top_k[0, 2:] == 0).all() and top_k[0, :2].sum().item() == pytest.approx(1.0)
    top_p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert (top_p[0] > 0).tolist() == [True, True, False, False]  # 0.64 < 0.7, so the second token stays
    cold = target_probs(logits, SamplingParams(temperature=0.1))
    assert cold[0, 0].item() > 0.99


def test_point_mass_verification_preserves_the_target_distribution():
    """Two positions, a fixed draft: the joint law of the first two output tokens must be p1 × p2."""
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]])
    draft = [1, 1]  # drafted tokens with p = 0.3 and then 0.6
    generator = torch.Generator().manual_seed(0)
    num_samples = 20_000
    counts = torch.zeros(3, 3)
    for _ in range(num_samples):
        first = verify_point_mass(probs, draft, generator)[0]
        if first == draft[0]:
            second = verify_point_mass(probs[1:], draft[1:], generator)[0]  # the step after an accepted draft
        else:
            second = int(torch.multinomial(probs[1], 1, generator=generator))
        counts[first, second] += 1
    expected = (probs[0][:, None] * probs[1][None, :]).flatten() * num_samples
    result = chisquare(counts.flatten().numpy(), expected.numpy())
    assert result.pvalue > 1e-3, result


def test_point_mass_rejection_never_returns_the_rejected_token():
    probs = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        out = verify_point_mass(probs, [0], generator)
        assert out[0] in (1, 2) and len(out) == 1
