"""The target distribution, inverse-CDF sampling and the per-position uniform stream."""
import pytest
import torch

from engine.sampler import UniformStream, inverse_cdf_samples, inverse_cdf_tensor, target_probs
from engine.wire import SamplingParams


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
    generator = torch.Generator().manual_seed(3)  # drawn ahead in chunks, the same as drawn one at a time
    assert whole == [1.0 - torch.rand(1, generator=generator, dtype=torch.float64).item() for _ in range(6)]


def test_inverse_cdf_over_a_large_vocabulary_is_the_first_token_reaching_u_times_the_mass():
    """Row by row on the host and all rows at once on a device: the token where one float64 cumulative sum over the
    row first reaches u * total, never one without mass (most of a row masked as top-k; uniforms at the edges)."""
    generator = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(4, 49_152, generator=generator) * 3, dim=-1)
    probs[2, probs[2] < probs[2].topk(7).values[-1]] = 0.0  # seven tokens left, scattered over the row
    probs[3, :-1] = 0.0  # all mass on the last token
    uniforms = [1e-12, 0.5, 1.0] + torch.rand(40, generator=generator, dtype=torch.float64).tolist()
    for row in range(4):
        cdf = probs[row].double().cumsum(-1)
        expected = [int(torch.searchsorted(cdf, u * cdf[-1:]).clamp(max=49_151)) for u in uniforms]
        rows = probs[row:row + 1].expand(len(uniforms), -1)
        assert inverse_cdf_samples(rows, uniforms) == expected == inverse_cdf_tensor(rows, uniforms).tolist()
        assert all(probs[row, token] > 0 for token in expected)
