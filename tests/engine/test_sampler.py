import pytest
import torch
from scipy.stats import chisquare

from engine.sampler import UniformStream, inverse_cdf_samples, target_probs, verify_greedy, verify_point_mass
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
    stream = UniformStream(torch.Generator().manual_seed(0))
    num_samples = 20_000
    counts = torch.zeros(3, 3)
    for _ in range(num_samples):
        tokens = verify_point_mass(probs, draft, stream.next(3))
        if len(tokens) == 1:  # the first draft was rejected: the next step samples position 2 afresh
            stream.advance(1)
            tokens += verify_point_mass(probs[1:2], [], stream.next(1))
        stream.advance(3)
        counts[tokens[0], tokens[1]] += 1
    expected = (probs[0][:, None] * probs[1][None, :]).flatten() * num_samples
    result = chisquare(counts.flatten().numpy(), expected.numpy())
    assert result.pvalue > 1e-3, result


def test_point_mass_rejection_never_returns_the_rejected_token():
    probs = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    stream = UniformStream(torch.Generator().manual_seed(1))
    for _ in range(200):
        out = verify_point_mass(probs, [0], stream.next(2))
        stream.advance(2)
        assert out[0] in (1, 2) and len(out) == 1


@pytest.mark.parametrize("draft", [[], [2], [0, 0], [1, 2, 0]])
def test_each_position_samples_the_same_token_whatever_was_drafted(draft):
    probs = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(2)), dim=-1)
    uniforms = [0.9, 0.15, 0.5, 0.7]
    own_samples = inverse_cdf_samples(probs, uniforms)
    tokens = verify_point_mass(probs, draft, uniforms[:len(draft) + 1])
    assert tokens == own_samples[:len(tokens)]


def test_inverse_cdf_never_picks_a_token_without_mass():
    probs = torch.tensor([[0.0, 0.4, 0.0, 0.6, 0.0]] * 4)
    assert inverse_cdf_samples(probs, [1e-12, 0.39, 0.41, 1.0]) == [1, 1, 3, 3]


def test_a_uniform_stream_gives_each_position_one_uniform_however_it_is_consumed():
    whole = UniformStream(torch.Generator().manual_seed(3)).next(6)
    stream = UniformStream(torch.Generator().manual_seed(3))
    seen = []
    for num_verified, num_used in ((3, 1), (1, 1), (4, 2), (2, 2)):
        uniforms = stream.next(num_verified)
        seen += uniforms[:num_used]
        stream.advance(num_used)
    assert seen == whole and all(0 < u <= 1 for u in whole)
