"""Session caches change no output of the embedded model on conversations built by the session benchmark's own
code from the tests' data sets (MT-Redundant-shaped rewrites and three-turn self-correction)."""
import pytest

from bench.data import load_questions
from bench.exactness import divergence_verdict
from bench.mt import render_prompt
from bench.sessions import mt_redundant_conversations, self_correction_conversations
from engine.config import EngineConfig, SessionConfig
from engine.engine import Engine
from engine.model.tokenizer import load_tokenizer
from engine.wire import SamplingParams
from tests.conftest import TEST_DATA_DIR
from tests.engine.helpers import run_to_completion

MT_REDUNDANT_CATEGORIES = ("writing", "coding", "extraction")
NUM_SELF_CORRECTION = 1
MAX_NEW_TOKENS = 64


@pytest.mark.slow
def test_greedy_output_with_sessions_equals_output_without_on_benchmark_conversations():
    tokenizer = load_tokenizer(EngineConfig().model)
    without = Engine(EngineConfig(sessions=SessionConfig(mode="off")))
    with_sessions = Engine(EngineConfig(sessions=SessionConfig(mode="implicit")))
    questions = [q for q in load_questions("mt-redundant", TEST_DATA_DIR) if q["category"] in MT_REDUNDANT_CATEGORIES]
    conversations = mt_redundant_conversations(questions)
    conversations += self_correction_conversations(load_questions("spec-bench", TEST_DATA_DIR), NUM_SELF_CORRECTION)
    assert len(conversations) == len(MT_REDUNDANT_CATEGORIES) + NUM_SELF_CORRECTION
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)]
    num_cached = 0
    for conversation in conversations:
        messages = []
        for turn, user_text in enumerate(conversation.user_turns, start=1):
            messages.append({"role": "user", "content": user_text})
            prompt = render_prompt(tokenizer, messages)
            reference = run_to_completion(without, [prompt], params)["req-0"]
            cached = run_to_completion(with_sessions, [prompt], params)["req-0"]
            verdict = divergence_verdict(without.runner.model, prompt, reference.new_token_ids, cached.new_token_ids)
            assert verdict != "mismatch", (conversation.session_id, turn)
            num_cached += cached.num_cached_tokens if turn > 1 else 0
            messages.append(
                {"role": "assistant", "content": tokenizer.decode(reference.new_token_ids, skip_special_tokens=True)}
            )
    assert num_cached > 0, "later turns must have reused their history for this test to mean something"
