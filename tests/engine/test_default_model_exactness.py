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


@pytest.fixture(scope="module")
def plain():
    """Plain decoding with the embedded model: every test's reference (an engine start costs seconds)."""
    return Engine(EngineConfig(spec=SpecConfig(drafter="none")))


@pytest.mark.slow
def test_copyspec_matches_plain_decoding_on_mt_redundant(plain):
    tokenizer = load_tokenizer(EngineConfig().model)
    copy = Engine(EngineConfig())
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
def test_requests_served_together_equal_each_served_alone(plain):
    """Continuous batching with chunked prefill and preemption changes no greedy output."""
    tokenizer = load_tokenizer(EngineConfig().model)
    alone_engine = plain
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


@pytest.mark.slow
def test_the_shipped_head_drafts_for_the_embedded_model_and_output_stays_plain(plain):
    """`--drafter draft` with no --draft-model: the EAGLE-3 head shipped for the embedded model (engine/model/heads/),
    its Linear layers in the target's weights mode, planner off so every step drafts."""
    tokenizer = load_tokenizer(EngineConfig().model)
    head = Engine(EngineConfig(spec=SpecConfig(drafter="draft", num_draft_tokens=5),
                               scheduler=SchedulerConfig(use_goodput_planner=False)))
    questions = [q for q in load_questions("mt-redundant", TEST_DATA_DIR) if q["category"] in CATEGORIES][:2]
    prompts = [turn_prompts(tokenizer, question, None) for question in questions]
    params = [SamplingParams(temperature=0.0, max_tokens=64)] * len(prompts)
    reference, drafted = run_to_completion(plain, prompts, params), run_to_completion(head, prompts, params)
    for i, prompt in enumerate(prompts):
        ref, out = reference[f"req-{i}"].new_token_ids, drafted[f"req-{i}"].new_token_ids
        assert divergence_verdict(plain.runner.model, prompt, ref, out) != "mismatch", i
    accepted = sum(o.spec.num_accepted_tokens for o in drafted.values())
    assert accepted > 0, "a head trained on the model's own answers must agree with it at times"
