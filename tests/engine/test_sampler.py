"""The target distribution, inverse-CDF sampling and the per-position uniform stream."""
import pytest
import torch

from engine.model.cpu_kernels import fused_ops_available
from engine.sampler import UniformStream, inverse_cdf_samples, inverse_cdf_tensor, sample_tokens, target_probs
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


needs_kernel = pytest.mark.skipif(not fused_ops_available(), reason="the fused sampler needs a C++ compiler on x86-64")


@needs_kernel
def test_the_fused_sampler_gives_each_token_its_share_of_evenly_spaced_uniforms():
    """Over N evenly spaced uniforms the inverse CDF gives each token N * p of them (within the one it shares with a
    neighbour at each boundary): the distribution itself, not a sample of it. 37 tokens (not a whole number of 16-token
    blocks), some masked, at a temperature."""
    logits = torch.randn(1, 37, generator=torch.Generator().manual_seed(2)) * 2
    logits[0, [0, 5, 36]] = float("-inf")
    params = SamplingParams(temperature=0.8)
    num = 20_000
    uniforms = [(k + 0.5) / num for k in range(num)]
    tokens = sample_tokens(logits.expand(num, -1).contiguous(), params, uniforms)
    counts = torch.bincount(torch.tensor(tokens), minlength=37).double()
    expected = target_probs(logits, params)[0].double() * num
    assert (counts - expected).abs().max() <= 1.0 + 1e-6
    assert counts[[0, 5, 36]].sum() == 0
    assert sample_tokens(logits, params, [1e-300]) == [1]  # masked tokens hold no mass at all, not exp(-87)


@needs_kernel
def test_the_fused_sampler_picks_the_token_whose_cdf_interval_holds_u():
    """On a 49,152-token row, top-k-like masks included, each token is where u * total falls in the float64 CDF of
    torch's probabilities, up to float32 rounding, and never one without mass; a row alone gives the token it gives
    in a batch."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 49_152, generator=generator) * 4
    logits[1, logits[1] < logits[1].topk(9).values[-1]] = float("-inf")
    params = SamplingParams(temperature=1.3)
    uniforms = [1e-9, 0.5, 1.0] + torch.rand(30, generator=generator, dtype=torch.float64).tolist()
    for row in range(3):
        rows = logits[row:row + 1].expand(len(uniforms), -1).contiguous()
        tokens = sample_tokens(rows, params, uniforms)
        assert tokens == [sample_tokens(logits[row:row + 1], params, [u])[0] for u in uniforms]
        probs = target_probs(logits[row:row + 1], params)[0].double()
        cdf = probs.cumsum(-1)
        for u, token in zip(uniforms, tokens):
            assert probs[token] > 0
            low = float(cdf[token - 1]) if token else 0.0
            assert low - 1e-5 <= u * float(cdf[-1]) <= float(cdf[token]) + 1e-5
