"""bench step-profile on the tiny model: a decode and a verify step timed phase by phase, operators sorted."""
from bench.step_profile import PHASES, profile_case
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
