"""Greedy CopySpec output equals plain decoding on MT-Redundant prompts with the embedded model."""
import pytest

from bench.data import load_questions
from bench.exactness import divergence_verdict
from bench.mt import turn_prompts
from drafters.config import SpecConfig
from engine.config import EngineConfig
from engine.engine import Engine
from engine.wire import SamplingParams
from server.tokenizer import load_tokenizer
from tests.engine.helpers import run_to_completion

QUESTION_IDS = (81, 105, 121, 135)  # writing, reasoning, coding, extraction
MAX_NEW_TOKENS = 96


@pytest.mark.slow
def test_copyspec_matches_plain_decoding_on_mt_redundant():
    tokenizer = load_tokenizer(EngineConfig().model)
    plain, copy = Engine(EngineConfig(spec=SpecConfig(drafter="none"))), Engine(EngineConfig())
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)]
    questions = [q for q in load_questions("mt-redundant") if q["question_id"] in QUESTION_IDS]
    num_accepted = 0
    for question in questions:
        turn1 = run_to_completion(plain, [turn_prompts(tokenizer, question, None)], params)["req-0"].new_token_ids
        prompt = turn_prompts(tokenizer, question, tokenizer.decode(turn1, skip_special_tokens=True))
        reference = run_to_completion(plain, [prompt], params)["req-0"]
        speculative = run_to_completion(copy, [prompt], params)["req-0"]
        verdict = divergence_verdict(plain.runner.model, prompt, reference.new_token_ids, speculative.new_token_ids)
        assert verdict != "mismatch", question["question_id"]
        num_accepted += speculative.spec.num_accepted_tokens
    assert num_accepted > 0, "turn 2 of MT-Redundant must give CopySpec something to copy"
