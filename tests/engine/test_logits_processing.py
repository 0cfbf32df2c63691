"""Penalties, logit bias and a grammar's mask as plain decoding applies them, and verification walking through them."""
import json
import math

import pytest
import torch
from llguidance import LLMatcher

from drafters.base import Draft
from engine.config import ModelConfig
from engine.grammar import GrammarError, Grammars
from engine.logits_processing import LogitsProcessor
from engine.logprobs import FORBIDDEN_LOGPROB, token_logprob
from engine.model.tokenizer import load_tokenizer
from engine.verifier import Verifier
from engine.wire import SamplingParams
from scheduler.request import Request

VOCAB = 8


def request(prompt, output, **params) -> Request:
    req = Request("r", list(prompt), SamplingParams(temperature=0.0, **params))
    req.all_token_ids += list(output)
    return req


def no_grammars() -> Grammars:
    return Grammars(lambda: None, VOCAB, [0])


def test_openai_penalties_count_generated_tokens_only():
    logits = torch.zeros(VOCAB)
    req = request([1, 2], [2, 3, 3], presence_penalty=0.5, frequency_penalty=0.25)
    processed = LogitsProcessor(req, no_grammars()).apply(logits)
    assert processed.tolist() == [0, 0, -0.75, -1.0, 0, 0, 0, 0]  # 1 is only in the prompt: untouched


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    logits = torch.tensor([2.0, -2.0, 2.0, -2.0, 2.0, 0, 0, 0])
    processed = LogitsProcessor(request([0, 1], [2], repetition_penalty=2.0), no_grammars()).apply(logits)
    assert processed.tolist() == [1.0, -4.0, 1.0, -2.0, 2.0, 0, 0, 0]


@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 1e308])
def test_an_extreme_repetition_penalty_keeps_the_distribution_finite(penalty):
    # the API takes any penalty > 0; 5e-324 and 1e-40 are 0 in float32, so division alone gives inf and then NaN
    logits = torch.tensor([2.0, -2.0, 3.0, -2.0, 2.0, 0, 0, 0])
    processed = LogitsProcessor(request([0, 1], [2], repetition_penalty=penalty), no_grammars()).apply(logits)
    assert torch.isfinite(processed).all()
    assert math.isfinite(token_logprob(processed, 2, SamplingParams(temperature=0.0, logprobs=0)).logprob)
    assert not torch.softmax(processed, dim=-1).isnan().any()


def test_bias_is_added_after_the_penalties_and_emitted_tokens_count_at_later_positions():
    processor = LogitsProcessor(request([1], [], frequency_penalty=1.0, logit_bias={4: 3.0}), no_grammars())
    assert processor.apply(torch.zeros(VOCAB))[4] == 3.0
    processor.emit(4)
    processor.emit(4)
    assert processor.apply(torch.zeros(VOCAB))[4] == 1.0


def test_greedy_verification_judges_each_drafted_token_by_the_walk_so_far():
    """Draft [5, 5]: token 5 leads every row, but a presence penalty of 2 makes the second 5 lose to token 6."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 5], logits[:, 6] = 3.0, 2.0
    req = request([1], [], presence_penalty=2.0)
    result, logprobs = Verifier(no_grammars()).verify(req, logits, [5, 5], [-1, 0])
    assert (result.token_ids, result.accepted_nodes, logprobs) == ([5, 6], [0], None)


def test_logprobs_are_of_the_processed_distribution_at_the_request_temperature():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125, 0, 0, 0, 0]) + 1e-30)
    entry = token_logprob(logits.float(), 1, SamplingParams(temperature=0.0, logprobs=2))
    assert entry.logprob == pytest.approx(torch.log(torch.tensor(0.25)).item())
    assert entry.top_token_ids == [0, 1]
    hot = token_logprob(logits.float(), 1, SamplingParams(temperature=2.0, logprobs=0))
    assert hot.logprob == pytest.approx(torch.log_softmax(logits / 2, -1)[1].item(), abs=1e-6)
    assert hot.top_token_ids == []
    masked = logits.clone()
    masked[2] = float("-inf")
    assert token_logprob(masked, 2, SamplingParams(temperature=0.0, logprobs=8)).logprob == FORBIDDEN_LOGPROB


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(model=None))


def json_grammars(tokenizer, schema) -> Grammars:
    grammars = Grammars(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammars.begin("r", LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False}))
    return grammars


def test_a_grammar_masks_what_it_forbids_and_cuts_drafts_to_their_grammatical_part(tokenizer):
    grammars = json_grammars(tokenizer, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    allowed = grammars.allowed("r")
    assert allowed.nonzero().flatten().tolist() == tokenizer.encode('{"')  # the required key's quote comes with it
    good = tokenizer.encode('{"a":12}', add_special_tokens=False)
    bad = tokenizer.encode('{"a":"x"}', add_special_tokens=False)
    chain = grammars.cut_draft("r", Draft(bad, "test"))
    assert 0 < len(chain) < len(bad) and chain.token_ids == bad[:len(chain)]
    first_bad = len(chain)
    branches = list(range(-1, len(bad) - 1)) + [-1] + list(range(len(bad), len(bad) + len(good) - 1))
    tree = grammars.cut_draft("r", Draft(bad + good, "test", branches))
    assert tree.token_ids == bad[:first_bad] + good  # the whole good branch stays, parents re-indexed
    assert tree.parents == list(range(-1, first_bad - 1)) + [-1] + list(range(first_bad, first_bad + len(good) - 1))
    for token in good:  # nothing was consumed by the cuts
        assert grammars.allowed("r")[token]
        grammars.consume("r", token)
    assert json.loads(tokenizer.decode(good)) == {"a": 12}
    assert grammars.allowed("r")[tokenizer.eos_token_id]


def test_a_grammar_that_does_not_compile_is_refused(tokenizer):
    grammars = Grammars(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    with pytest.raises(GrammarError):
        grammars.begin("r", LLMatcher.grammar_from_regex("[a-"))
    assert not grammars.has("r")
