"""Multi-turn conversations through the engine on a tiny random model: session caches change speed, never output."""
import random

import pytest

from bench.exactness import divergence_verdict
from drafters.config import SpecConfig
from engine.config import CacheConfig, EngineConfig, ModelConfig, SessionConfig
from engine.engine import Engine
from engine.wire import EngineRequest, SamplingParams
from scheduler.config import SchedulerConfig
from tests.conftest import TINY_VOCAB

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# K and V, 2 layers, 2 KV heads, head_dim 8, float32: the tiny model's KV per position
POSITION_BYTES = 2 * 2 * 2 * 8 * 4


def make_engine(model_dir, mode, drafter="copyspec", num_blocks=None, max_num_seqs=8):
    cache = (CacheConfig() if num_blocks is None
             else CacheConfig(kv_cache_memory_gib=num_blocks * 16 * POSITION_BYTES / 2**30))
    return Engine(EngineConfig(
        model=ModelConfig(model=model_dir, device="cpu"),
        cache=cache,
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
        spec=SpecConfig(drafter=drafter, copy_gamma=2),
        sessions=SessionConfig(mode=mode),
    ))


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return {mode: make_engine(tiny_model_dir, mode) for mode in ("off", "explicit", "implicit")}


def run_turn(engine, request_id, prompt, session_id=None, params=GREEDY):
    """One request to completion, alone; returns (output token ids, the finishing output, every step's stats)."""
    assert engine.add_request(EngineRequest(request_id, prompt, params, session_id)) is None
    tokens, stats = [], []
    while engine.has_work:
        step = engine.step()
        stats.append(step.stats)
        for output in step.outputs:
            tokens += output.new_token_ids
            if output.finish_reason:
                final = output
    return tokens, final, stats


def conversation(seed):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(20, 40))] for _ in range(3)]


def replay(engine, name, user_turns, session_id=None):
    """Each turn's prompt is the history so far, the engine's own answers included; returns per turn (output, final)."""
    history, turns = [], []
    for i, user in enumerate(user_turns):
        prompt = history + user
        output, final, _ = run_turn(engine, f"{name}-{i}", prompt, session_id)
        turns.append((prompt, output, final))
        history = prompt + output
    return turns


@pytest.mark.parametrize("mode, session_id", [("explicit", "chat-7"), ("implicit", None)])
def test_every_turn_answers_as_without_sessions_while_reusing_the_history(engines, mode, session_id):
    reference = replay(engines["off"], "ref", conversation(0))
    cached = replay(engines[mode], f"{mode}", conversation(0), session_id)
    model = engines["off"].runner.model
    for (prompt, expected, plain), (_, output, final) in zip(reference, cached):
        assert divergence_verdict(model, prompt, expected, output) != "mismatch"
        assert plain.num_cached_tokens == 0
    for (prompt, output, _), (_, _, next_final) in zip(cached, cached[1:]):
        computed = len(prompt) + len(output) - 1  # the history's positions with KV: all but the last token
        assert next_final.num_cached_tokens == computed - computed % 16  # its full blocks


def test_a_client_that_edits_an_earlier_turn_is_answered_as_without_sessions(engines):
    turns = conversation(1)
    replay(engines["implicit"], "first", turns)
    edited = list(turns[0])
    edited[len(edited) // 2] = 3 if edited[len(edited) // 2] != 3 else 4
    expected, _, _ = run_turn(engines["off"], "edited-ref", edited)
    output, final, _ = run_turn(engines["implicit"], "edited", edited)
    assert divergence_verdict(engines["off"].runner.model, edited, expected, output) != "mismatch"
    assert final.num_cached_tokens == (len(edited) // 2) // 16 * 16  # only the blocks before the edit


def test_explicit_mode_ignores_requests_that_name_no_session(engines):
    turns = conversation(2)
    replay(engines["explicit"], "anon", turns[:2])
    _, final, _ = run_turn(engines["explicit"], "anon-again", turns[0] + [5, 6])
    assert final.num_cached_tokens == 0


def test_session_stats_count_hits_misses_reuse_and_sessions(tiny_model_dir):
    engine = make_engine(tiny_model_dir, "implicit")
    turns = conversation(3)
    output, _, first = run_turn(engine, "t0", turns[0])
    assert (first[0].session_hits, first[0].session_misses, first[-1].num_sessions) == (0, 1, 1)
    _, final, stats = run_turn(engine, "t1", turns[0] + output + turns[1])
    assert stats[0].session_hits == 1 and stats[0].session_reused_tokens == final.num_cached_tokens > 0
    assert sum(s.session_evictions for s in stats) == 0


def test_sessions_give_way_to_requests_in_a_tight_pool_and_every_request_still_succeeds(tiny_model_dir):
    """12 blocks of 16 positions: each finished conversation leaves 2-3 blocks behind, so new ones must evict."""
    tight = make_engine(tiny_model_dir, "implicit", num_blocks=12, max_num_seqs=2)
    roomy = make_engine(tiny_model_dir, "off")
    evictions = preemptions = 0
    for seed in range(8):
        user_turns = conversation(100 + seed)[:2]
        for (prompt, expected, _), turn in zip(replay(roomy, f"roomy-{seed}", user_turns), range(2)):
            output, final, stats = run_turn(tight, f"tight-{seed}-{turn}", prompt)
            assert final.finish_reason == "length"
            assert divergence_verdict(roomy.runner.model, prompt, expected, output) != "mismatch"
            evictions += sum(s.session_evictions for s in stats)
            preemptions += sum(s.num_preemptions for s in stats)
    assert evictions > 0, "the pool must run short for this test to mean something"
    assert preemptions == 0, "a lone request never needs to preempt while sessions can give blocks back"
    assert tight.scheduler.blocks.usage == 0
