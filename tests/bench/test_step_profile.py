"""bench step-profile on the tiny model: a decode and a verify step timed phase by phase, operators sorted; a draft
model's drafting step beside the same engine's decode steps; the row ladder at batch 1; a single stream of
none and draft."""
from dataclasses import replace

from bench.step_profile import (
    LADDER,
    MODEL_DRAFT_TOKENS,
    PHASES,
    decode_between_drafts,
    ladder_markdown,
    prefilled_engine,
    profile_case,
    row_ladder,
    single_stream,
    stream_markdown,
)
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
    assert MODEL_DRAFT_TOKENS <= row["drafted_per_request"] <= 3 * MODEL_DRAFT_TOKENS  # levels, and a tree's siblings
    engine = prefilled_engine(replace(config, spec=replace(config.spec, num_draft_tokens=MODEL_DRAFT_TOKENS)),
                              prompts)
    engine.step()  # drafts for the next step
    phases, _, num_tokens = decode_between_drafts(engine)
    assert num_tokens == 2  # one token a request: no draft verified
    assert engine.speculation.drafter.max_tokens == MODEL_DRAFT_TOKENS


def test_the_row_ladder_verifies_each_count_of_drafted_tokens_at_batch_1(tiny_model_dir):
    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"), cache=CacheConfig(0.05),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512, use_goodput_planner=False),
        spec=SpecConfig(drafter="copyspec"),
    )
    ladder = row_ladder(config, [5 + j % 40 for j in range(64)])
    assert ladder["tokens_by_drafted"] == {count: count + 1 for count in LADDER}  # the drafts and the real token
    assert list(ladder["step_ms_by_drafted"]) == list(LADDER) and min(ladder["step_ms_by_drafted"].values()) > 0
    share = ladder["ms_per_row"] / ladder["step_ms_by_drafted"][0]
    assert abs(ladder["row_share_of_decode"] - share) <= 0.01 * abs(share) + 1e-4
    table = ladder_markdown(ladder)
    assert table[3] == "| drafted tokens | " + " | ".join(map(str, LADDER)) + " |"


def test_a_single_stream_sets_the_head_beside_plain_decoding_step_by_step(tiny_model_dir, tiny_head_dir):
    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu", draft_model=tiny_head_dir), cache=CacheConfig(0.05),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512, use_goodput_planner=False),
        spec=SpecConfig(drafter="copyspec", num_draft_tokens=3),
    )
    prompts = [[5 + (i * 7 + j) % 40 for j in range(48)] for i in range(3)]
    stream = single_stream(config, prompts, max_tokens=24)
    none, draft = stream["drafters"]["none"], stream["drafters"]["draft"]
    assert none["verified_per_step"] == 0 and none["accepted_share"] is None
    assert draft["verified_per_step"] >= 3  # the planner off: every step verifies a tree 3 deep
    # a step yields its accepted drafted tokens and one of the target's own
    assert abs(draft["tokens_per_step"] - 1 - draft["verified_per_step"] * draft["accepted_share"]) < 0.01
    assert stream["questions"] == 2 and stream["speedup"] > 0
    assert stream_markdown(stream)[-1].startswith("`draft` ÷ `none`")
