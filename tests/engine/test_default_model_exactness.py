"""Greedy CopySpec output equals plain decoding with the embedded model, on conversations in MT-Redundant's shape
(tests/data: a long first answer that the second turn asks to rewrite)."""
import pytest

from bench.data import load_questions
from bench.exactness import divergence_verdict
from bench.mt import turn_prompts
from drafters.config import SpecConfig
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model.tokenizer import load_tokenizer
from engine.wire import SamplingParams
from scheduler.config import SchedulerConfig
from tests.conftest import TEST_DATA_DIR
from tests.engine.helpers import run_to_completion

CATEGORIES = ("writing", "reasoning", "coding", "extraction")
MAX_NEW_TOKENS = 96


@pytest.mark.slow
def test_copyspec_matches_plain_decoding_on_mt_redundant():
    tokenizer = load_tokenizer(EngineConfig().model)
    plain, copy = Engine(EngineConfig(spec=SpecConfig(drafter="none"))), Engine(EngineConfig())
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)]
    questions = [q for q in load_questions("mt-redundant", TEST_DATA_DIR) if q["category"] in CATEGORIES]
    assert len(questions) == len(CATEGORIES)
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


@pytest.mark.slow
def test_requests_served_together_equal_each_served_alone():
    """Continuous batching with chunked prefill and preemption changes no greedy output."""
    tokenizer = load_tokenizer(EngineConfig().model)
    alone_engine = Engine(EngineConfig(spec=SpecConfig(drafter="none")))
    tight = EngineConfig(
        cache=CacheConfig(kv_cache_memory_gib=0.025),  # 576 positions: the batch needs about 1,100 at once
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),  # prompts are prefilled in chunks
    )
    together_engine = Engine(tight)
    questions = load_questions("mt-redundant", TEST_DATA_DIR)[:8]
    assert len(questions) == 8
    prompts = [turn_prompts(tokenizer, question, None) for question in questions]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    stats = []
    together = run_to_completion(together_engine, prompts, [params] * len(prompts), stats)
    assert sum(s.num_preemptions for s in stats) > 0, "the pool must run full for this test to mean something"
    assert max(s.num_scheduled_tokens for s in stats) == 64 and max(s.num_running for s in stats) > 1
    # every request gave its blocks back (cached sessions may hold some)
    assert together_engine.scheduler.blocks.usage == 0
    for i, prompt in enumerate(prompts):
        alone = run_to_completion(alone_engine, [prompt], [params])["req-0"].new_token_ids
        verdict = divergence_verdict(alone_engine.runner.model, prompt, alone, together[f"req-{i}"].new_token_ids)
        assert verdict != "mismatch", questions[i]["question_id"]
