"""Prometheus metrics fed by engine step stats and request outputs."""
from engine.wire import DraftStepStats, RequestOutput, StepStats
from server.metrics import ServerMetrics

MODEL = "tiny"


def sample(metrics, name, **labels):
    return metrics.registry.get_sample_value("specserve:" + name, {"model_name": MODEL, **labels})


def test_step_stats_feed_gauges_and_per_drafter_counters():
    metrics = ServerMetrics(MODEL)
    spec = DraftStepStats(num_drafts=2, num_draft_tokens=7, num_accepted_tokens=4, num_accepted_per_position=[2, 1, 1])
    for _ in range(2):
        metrics.observe_step(
            StepStats(
                num_running=3,
                num_waiting=1,
                num_offered_draft_tokens=9,
                num_verified_draft_tokens=7,
                step_seconds=0.05,
                spec_by_drafter={"copyspec": spec},
            )
        )
    assert sample(metrics, "num_requests_running") == 3 and sample(metrics, "num_requests_waiting") == 1
    assert sample(metrics, "spec_decode_num_drafts_total", drafter="copyspec") == 4
    assert sample(metrics, "spec_decode_num_draft_tokens_total", drafter="copyspec") == 14
    assert sample(metrics, "spec_decode_num_accepted_tokens_total", drafter="copyspec") == 8
    assert sample(metrics, "spec_decode_num_accepted_tokens_per_pos_total", drafter="copyspec", position="0") == 4
    assert sample(metrics, "spec_decode_num_offered_tokens_total") == 18
    assert sample(metrics, "spec_decode_num_verified_tokens_total") == 14
    assert sample(metrics, "engine_step_seconds_count") == 2


def test_request_timer_observes_ttft_itl_and_e2e():
    metrics = ServerMetrics(MODEL)
    timer = metrics.request_timer()
    timer.on_output(RequestOutput("r", [5]))
    timer.on_output(RequestOutput("r", [6, 7, 8]))
    timer.on_output(RequestOutput("r", [2], finish_reason="stop", num_prompt_tokens=11))
    assert sample(metrics, "time_to_first_token_seconds_count") == 1
    assert sample(metrics, "inter_token_latency_seconds_count") == 4
    assert sample(metrics, "e2e_request_latency_seconds_count") == 1
    assert sample(metrics, "generation_tokens_total") == 5
    assert sample(metrics, "prompt_tokens_total") == 11
    assert sample(metrics, "request_success_total", finished_reason="stop") == 1


def test_engine_health_gauge():
    metrics = ServerMetrics(MODEL)
    metrics.set_engine_healthy(True)
    assert sample(metrics, "engine_healthy") == 1
    metrics.set_engine_healthy(False)
    assert sample(metrics, "engine_healthy") == 0


def test_series_without_extra_labels_export_zero_before_any_step():
    metrics = ServerMetrics(MODEL)
    for name in (
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "session_cache_hits_total",
        "session_cache_misses_total",
        "session_cache_reused_prefix_tokens_total",
        "session_cache_evictions_total",
        "session_cache_num_sessions",
        "engine_healthy",
        "generation_tokens_total",
        "time_to_first_token_seconds_count",
    ):
        assert sample(metrics, name) == 0, name


def test_kv_and_session_fields_feed_their_series_when_the_engine_sends_them():
    stats = StepStats(
        kv_cache_usage=0.25, num_preemptions=1, session_hits=2, session_misses=1, session_reused_tokens=40,
        session_evictions=1, num_sessions=3,
    )
    metrics = ServerMetrics(MODEL)
    metrics.observe_step(stats)
    metrics.observe_step(stats)
    assert sample(metrics, "kv_cache_usage_perc") == 0.25
    assert sample(metrics, "num_preemptions_total") == 2
    assert sample(metrics, "session_cache_hits_total") == 4
    assert sample(metrics, "session_cache_misses_total") == 2
    assert sample(metrics, "session_cache_reused_prefix_tokens_total") == 80
    assert sample(metrics, "session_cache_evictions_total") == 2
    assert sample(metrics, "session_cache_num_sessions") == 3


def test_later_turns_feed_session_hits_and_misses_by_kind_both_kinds_exported_from_the_start():
    metrics = ServerMetrics(MODEL)
    for kind in ("explicit", "implicit"):
        assert sample(metrics, "session_hits_total", kind=kind) == 0
        assert sample(metrics, "session_misses_total", kind=kind) == 0
    stats = StepStats(conversation_hits={"explicit": 2, "implicit": 1}, conversation_misses={"implicit": 3})
    metrics.observe_step(stats)
    metrics.observe_step(stats)
    assert sample(metrics, "session_hits_total", kind="explicit") == 4
    assert sample(metrics, "session_hits_total", kind="implicit") == 2
    assert sample(metrics, "session_misses_total", kind="implicit") == 6
    assert sample(metrics, "session_misses_total", kind="explicit") == 0


def test_the_planners_calibration_is_a_gauge_per_drafter_and_decoding():
    metrics = ServerMetrics(MODEL)
    metrics.observe_step(StepStats(acceptance_calibration={"spectra": {"sampled": 0.6, "greedy": 1.1}}))
    metrics.observe_step(StepStats(acceptance_calibration={"spectra": {"sampled": 0.55}}))
    assert sample(metrics, "planner_acceptance_calibration", drafter="spectra", decoding="sampled") == 0.55
    assert sample(metrics, "planner_acceptance_calibration", drafter="spectra", decoding="greedy") == 1.1
