"""bench step-profile on the tiny model: a decode and a verify step timed phase by phase, operators sorted; a draft
model's drafting step beside the same engine's decode steps."""
from dataclasses import replace

from bench.step_profile import MODEL_DRAFT_TOKENS, PHASES, decode_between_drafts, prefilled_engine, profile_case
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig


def test_a_decode_and_a_verify_step_are_timed_phase_by_phase_and_their_operators_sorted(tiny_model_dir):
    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"), cache=CacheConfig(0.05),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512, use_goodput_planner=False),
        spec=SpecConfig(drafter="copyspec"),
    )
    prompts = [[5 + (i * 7 + j) % 40 for j in range(64)] for i in range(2)]
    decode = profile_case(config, prompts, verify=False)
    verify = profile_case(config, prompts, verify=True)
    assert (decode["step"], decode["tokens"]) == ("decode", 2)
    assert (verify["step"], verify["tokens"]) == ("verify 16", 32)  # 15 drafted tokens and the last real one each
    for row in (decode, verify):
        assert list(row["phases_ms"]) == list(PHASES) and all(ms >= 0 for ms in row["phases_ms"].values())
        assert row["forward_ms"]["matmuls"] + row["forward_ms"]["whole layers"] > 0


def test_a_drafting_step_is_set_beside_plain_decode_steps_of_the_same_engine(tiny_model_dir, tiny_head_dir):
    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu", draft_model=tiny_head_dir), cache=CacheConfig(0.05),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512, use_goodput_planner=False),
        spec=SpecConfig(drafter="draft"),
    )
    prompts = [[5 + (i * 7 + j) % 40 for j in range(64)] for i in range(2)]
    row = profile_case(config, prompts, verify=False, model_draft=True)
    assert (row["step"], row["tokens"]) == (f"draft {MODEL_DRAFT_TOKENS}", 2)  # after a plain step: one token each
    assert row["phases_ms"]["draft"] > 0 and row["decode_step_ms"] > 0
    engine = prefilled_engine(replace(config, spec=replace(config.spec, num_draft_tokens=MODEL_DRAFT_TOKENS)),
                              prompts)
    engine.step()  # drafts for the next step
    phases, _, num_tokens = decode_between_drafts(engine)
    assert num_tokens == 2  # one token a request: no draft verified
    assert engine.speculation.drafter.max_tokens == MODEL_DRAFT_TOKENS
