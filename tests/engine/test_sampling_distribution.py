"""Sampling with speculation must draw from the same distribution as plain sampling (chi-square), with one
candidate per position, with several (a tree, SPECTRA's multi-candidate rule), and with SPECTRA's look-ahead rows in
the forward, and with its guesses from the model's own next tokens."""
from collections import Counter

import pytest
from scipy.stats import chi2_contingency

from drafters.base import Draft, DrafterBase
from drafters.config import SpecConfig
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.wire import SamplingParams
from scheduler.config import SchedulerConfig
from tests.engine.helpers import run_to_completion

NUM_SAMPLES = 1500
PROMPT = [1, 7, 8, 9, 7, 8]


class FixedDrafter(DrafterBase):
    """Always drafts the same tree: a point-mass drafter whose drafts are often rejected."""

    name = "fixed"

    def __init__(self, token_ids, parents=None):
        self.token_ids = token_ids
        self.parents = parents

    def begin(self, req, state=None):
        pass

    def extend(self, req, new_token_ids):
        pass

    def propose(self, reqs):
        return [Draft(list(self.token_ids), self.name, self.parents) for _ in reqs]

    def finish(self, req):
        return None


def sample_pairs(engine, params, prompt=PROMPT):
    """Counts of (2nd, 3rd) generated token, the positions the drafter speculates on; accepted drafts."""
    outputs = run_to_completion(engine, [prompt] * NUM_SAMPLES, [params] * NUM_SAMPLES)
    num_accepted = sum(o.spec.num_accepted_tokens for o in outputs.values())
    return Counter(tuple(o.new_token_ids[1:3]) for o in outputs.values()), num_accepted


def assert_same_distribution(plain: Counter, speculative: Counter) -> None:
    """Chi-square of the two samples' counts, cells too sparse for the test (< 5 in all) left out."""
    keys = sorted(set(plain) | set(speculative))
    columns = zip([plain.get(k, 0) for k in keys], [speculative.get(k, 0) for k in keys])
    table = [column for column in columns if sum(column) >= 5]
    result = chi2_contingency(list(zip(*table)))
    assert result.pvalue > 1e-3, result


@pytest.mark.slow
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.9, max_tokens=3, ignore_eos=True),
    SamplingParams(  # penalties and bias move the distribution at the drafted positions, counting the walk's tokens
        temperature=1.0, max_tokens=3, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5,
        repetition_penalty=1.3, logit_bias={7: 2.0, 9: -3.0, 11: 1.5},
    ),
], ids=["plain", "top-k-top-p", "penalties-bias"])
def test_speculative_sampling_matches_plain_sampling(tiny_model_dir, params, tree):
    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"),
        cache=CacheConfig(0.05),  # the pool is zeroed at start-up: a small one for this tiny model
        scheduler=SchedulerConfig(
            max_num_seqs=NUM_SAMPLES,
            max_num_batched_tokens=32 * NUM_SAMPLES,
            max_waiting=NUM_SAMPLES,
            use_goodput_planner=False,
        ),
        spec=SpecConfig(drafter="none"),
    )
    plain_engine, spec_engine = Engine(config), Engine(config)
    plain, _ = sample_pairs(plain_engine, params)
    (second, third), _ = plain.most_common(1)[0]
    if tree:  # the likeliest pair, and siblings at both depths: the runner-up second tokens, and another third
        (runner_up, _), _ = next((pair, n) for pair, n in plain.most_common() if pair[0] != second)
        drafter = FixedDrafter([runner_up, second, third, (third + 1) % 40 + 3], [-1, -1, 1, 1])
    else:
        drafter = FixedDrafter([second, third])  # accepted often, rejected often: both paths run
    spec_engine.speculation.drafter = drafter
    speculative, num_accepted = sample_pairs(spec_engine, params)
    assert 20 <= num_accepted < NUM_SAMPLES  # both the accept and the reject path ran
    assert_same_distribution(plain, speculative)


def sampling_engine(model_dir: str, drafter: str, draft_model: str | None = None) -> Engine:
    """The tiny model sampling NUM_SAMPLES requests at once, drafting 2 tokens every step (planner off)."""
    return Engine(EngineConfig(
        model=ModelConfig(model=model_dir, device="cpu", draft_model=draft_model),
        cache=CacheConfig(0.05),  # a small pool for this tiny model
        scheduler=SchedulerConfig(
            max_num_seqs=NUM_SAMPLES, max_num_batched_tokens=32 * NUM_SAMPLES, max_waiting=NUM_SAMPLES,
            use_goodput_planner=False,
        ),
        spec=SpecConfig(drafter=drafter, num_draft_tokens=2),
    ))


@pytest.mark.slow
def test_sampling_with_a_draft_model_matches_plain_sampling(tiny_model_dir):
    """Drafts sampled from an early exit of the target, verified by min(1, p/q) and the residual (p - q)+."""
    params = SamplingParams(temperature=0.8, top_k=10, max_tokens=3, ignore_eos=True)
    plain, _ = sample_pairs(sampling_engine(tiny_model_dir, "none"), params)
    speculative, num_accepted = sample_pairs(sampling_engine(tiny_model_dir, "draft", "early-exit:1"), params)
    assert 20 <= num_accepted < 2 * NUM_SAMPLES  # accepted and rejected drafts both ran
    assert_same_distribution(plain, speculative)


@pytest.mark.slow
def test_sampling_with_a_head_matches_plain_sampling(tiny_model_dir, tiny_head_dir):
    """Drafts sampled from an EAGLE-3 head over half the vocabulary (conftest's tiny_head_dir): q is 0 on every odd
    token id, which the residual (p - q)+ must then give exactly its probability under p."""
    params = SamplingParams(temperature=0.8, top_k=10, max_tokens=3, ignore_eos=True)
    plain, _ = sample_pairs(sampling_engine(tiny_model_dir, "none"), params)
    speculative, num_accepted = sample_pairs(sampling_engine(tiny_model_dir, "draft", tiny_head_dir), params)
    assert 20 <= num_accepted < 2 * NUM_SAMPLES  # accepted and rejected drafts both ran
    assert sum(count for (second, third), count in plain.items() if second % 2 or third % 2) > NUM_SAMPLES // 4
    assert_same_distribution(plain, speculative)


def spectra_engine(tiny_model_dir, drafter):
    return Engine(EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"),
        cache=CacheConfig(0.05),  # the pool is zeroed at start-up: a small one for this tiny model
        scheduler=SchedulerConfig(
            max_num_seqs=NUM_SAMPLES, max_num_batched_tokens=32 * NUM_SAMPLES, max_waiting=NUM_SAMPLES,
            use_goodput_planner=False,
        ),
        # rows within 32 a request; no traffic index (each finished sample would be drafted from)
        spec=SpecConfig(drafter=drafter, spectra_guesses=3, spectra_pool=2, spectra_index_mib=0),
    ))


def greedy_cycle_prompt(plain_engine) -> list[int]:
    """PROMPT and the model's own greedy answer: a prompt ending in its greedy cycle, so that guesses from its
    n-grams are sometimes sampled too."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return PROMPT + run_to_completion(plain_engine, [PROMPT], [greedy])["req-0"].new_token_ids


@pytest.mark.slow
def test_spectra_sampling_with_lookahead_rows_matches_plain_sampling(tiny_model_dir):
    """SPECTRA's own drafter: its guesses as one tree and its candidate pool's look-ahead rows in the same forward
    (planner off: every chain carried), sampled at T = 1 by the multi-candidate rule."""
    plain_engine = spectra_engine(tiny_model_dir, "none")
    prompt = greedy_cycle_prompt(plain_engine)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    plain, _ = sample_pairs(plain_engine, params, prompt)
    spectra = spectra_engine(tiny_model_dir, "spectra-core")
    speculative, num_accepted = sample_pairs(spectra, params, prompt)
    assert 20 <= num_accepted < 2 * NUM_SAMPLES  # accepted and rejected guesses both ran
    assert spectra.speculation.drafter.lookahead_yield.rows >= NUM_SAMPLES  # the pool's rows were in the forwards
    assert_same_distribution(plain, speculative)


@pytest.mark.slow
def test_spectra_sampling_with_model_ngram_guesses_matches_plain_sampling(tiny_model_dir):
    """SPECTRA drafting from the table of the model's own next tokens alone (drafters/model_ngrams.py; its
    dictionaries set aside), the table holding the model's greedy cycle as the prompt shows it: its guesses are the
    likeliest tokens, sampled often and rejected often at T = 1."""
    from drafters.model_ngrams import ModelNgrams

    plain_engine = spectra_engine(tiny_model_dir, "none")
    prompt = greedy_cycle_prompt(plain_engine)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    plain, _ = sample_pairs(plain_engine, params, prompt)
    spectra = spectra_engine(tiny_model_dir, "spectra")
    drafter = spectra.speculation.drafter
    drafter.dictionaries = frozenset()
    drafter.model_ngrams = ModelNgrams.from_predictions([(prompt[:-1], prompt[1:], [0.9] * len(prompt))])
    speculative, num_accepted = sample_pairs(spectra, params, prompt)
    tried = sum(tried for (kind, _), (tried, _) in drafter.rates.scored().items() if kind.startswith("model:"))
    assert tried >= NUM_SAMPLES // 4  # the table's guesses were drafted (where a sample's context is in it)
    assert 20 <= num_accepted < tried  # accepted and rejected both
    assert_same_distribution(plain, speculative)
