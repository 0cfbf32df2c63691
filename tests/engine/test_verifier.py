"""Tree verification: the target's own token at every depth, the drafted child that equals it, and nothing else."""
import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from engine.sampler import UniformStream, inverse_cdf_samples
from engine.verifier import verify_greedy, verify_sampled
from engine.wire import SamplingParams

VOCAB = 6
T1 = SamplingParams(temperature=1.0)  # sampling from the logits' softmax as it is


# Trees as (draft tokens, parents); argmax per row (root first); expected tokens and accepted nodes.
@pytest.mark.parametrize(
    "tokens, parents, argmax_rows, expected_tokens, expected_nodes",
    [
        ([], [], [3], [3], []),  # no draft: plain greedy
        ([1, 2], [-1, 0], [1, 2, 4], [1, 2, 4], [0, 1]),  # a chain, all accepted, then the bonus token
        ([1, 3], [-1, 0], [1, 2, 4], [1, 2], [0]),  # a chain, second rejected: the target's token replaces it
        ([1, 2, 4, 5], [-1, 0, -1, 2], [4, 0, 0, 5, 3], [4, 5, 3], [2, 3]),  # the right answer is the second branch
        ([1, 2, 3, 4, 5], [-1, 0, 1, 2, 2], [1, 2, 3, 5, 0, 0], [1, 2, 3, 5, 0], [0, 1, 2, 4]),  # deep, a late sibling
        ([1, 2, 4, 5], [-1, 0, -1, 2], [3, 0, 0, 0, 0], [3], []),  # in no branch
        ([1, 2, 1], [-1, 0, 0], [1, 1, 0, 0], [1, 1, 0], [0, 2]),  # siblings under an accepted node: the second wins
    ],
    ids=["no-draft", "chain-all", "chain-reject", "second-branch", "deep-branch", "none", "second-child"],
)
def test_greedy_walks_the_tree(tokens, parents, argmax_rows, expected_tokens, expected_nodes):
    result = verify_greedy(argmax_rows, tokens, parents)
    assert (result.token_ids, result.accepted_nodes) == (expected_tokens, expected_nodes)


def model_distribution(prefix: tuple) -> torch.Tensor:
    """A made-up target over VOCAB tokens whose next-token law depends on the whole prefix."""
    generator = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.softmax(torch.randn(VOCAB, generator=generator) * 1.5, dim=-1)


def sample_two_tokens(tokens, parents, stream):
    """Verify a draft tree against the made-up target, then sample plainly up to two output tokens."""
    rows = [model_distribution(())] + [model_distribution(tuple(path(parents, tokens, j))) for j in range(len(tokens))]
    logits = torch.stack(rows).log()  # softmax at T = 1 gives the rows back
    result = verify_sampled(logits, tokens, parents, T1, stream.next(len(tokens) + 1))
    stream.advance(len(result.token_ids))
    out = result.token_ids
    while len(out) < 2:  # the next steps sample plainly, each from its position's own uniform
        out.append(inverse_cdf_samples(model_distribution(tuple(out))[None], stream.next(1))[0])
        stream.advance(1)
    return tuple(out[:2])


def path(parents, tokens, node):
    nodes = []
    while node != -1:
        nodes.append(node)
        node = parents[node]
    return [tokens[n] for n in reversed(nodes)]


@pytest.mark.parametrize(
    "tokens, parents",
    [
        ([0, 1, 2], [-1, -1, -1]),  # three candidates for the first token
        ([0, 1, 0, 3, 2], [-1, 0, 0, -1, 3]),  # two candidates at each of two depths
        ([5, 4, 3], [-1, 0, 1]),  # a chain
    ],
    ids=["siblings", "two-levels", "chain"],
)
def test_multi_candidate_sampling_keeps_the_target_distribution(tokens, parents):
    """Chi-square of the first two output tokens against the made-up target's exact joint law."""
    stream = UniformStream(torch.Generator().manual_seed(7))
    num_samples = 12_000
    counts = Counter(sample_two_tokens(tokens, parents, stream) for _ in range(num_samples))
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    joint = [float(model_distribution(())[a]) * float(model_distribution((a,))[b]) for a, b in pairs]
    expected = [p * num_samples / sum(joint) for p in joint]  # float32 rounding: make it sum exactly
    observed = [counts.get(pair, 0) for pair in pairs]
    assert sum(observed) == num_samples
    assert chisquare(observed, expected).pvalue > 1e-3


def test_a_depths_token_does_not_depend_on_what_was_drafted():
    probs = torch.softmax(torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)), dim=-1)
    uniforms = [0.9, 0.15, 0.5]
    own = inverse_cdf_samples(probs[:1], uniforms[:1])[0]
    for tokens, parents in (([], []), ([own], [-1]), ([(own + 1) % VOCAB, own], [-1, -1])):
        assert verify_sampled(probs.log(), tokens, parents, T1, uniforms).token_ids[0] == own


def test_the_residual_rule_emits_every_token_with_the_target_probability():
    """min(1, p/q) then (p - q)+ renormalised: the first emitted token is distributed as p whatever q drafted."""
    import torch
    from scipy.stats import chisquare

    from engine.verifier import walk_residual

    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
    q = torch.tensor([0.1, 0.1, 0.3, 0.3, 0.2])
    counts = torch.zeros(5)
    num_samples = 20000
    for _ in range(num_samples):
        drafted = int(torch.multinomial(q, 1, generator=generator))
        uniforms = (1 - torch.rand(4, generator=generator, dtype=torch.float64)).tolist()
        result = walk_residual(lambda row: p, [drafted], q[None], uniforms[:2], uniforms[2:], lambda token: None)
        counts[result.token_ids[0]] += 1
    assert counts[4] == 0, "a token the target gives no mass is never emitted"
    assert chisquare(counts[:4].numpy(), (p[:4] * num_samples).numpy()).pvalue > 1e-3


def test_a_large_vocabularys_argmax_in_two_stages_is_the_first_largest_logit():
    from engine.sampler import greedy_tokens

    logits = torch.randn(5, 262144, generator=torch.Generator().manual_seed(0))
    logits[1, 1000] = logits[1, 200_000] = 99.0  # a tie across slices: the first index wins
    logits[2, 7] = logits[2, 9] = 99.0  # a tie within a slice
    logits[3] = 0.0  # all equal
    assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist() == [greedy_tokens(logits)[0], 1000, 7, 0,
                                                                      greedy_tokens(logits)[4]]
