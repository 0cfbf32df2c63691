"""Prometheus metrics, owned by the server process and fed by the engine's per-step outputs.

Names follow vLLM's (prefix `specserve:`) so existing queries port; every series
carries `model_name`, and the speculative ones a `drafter` label. Series without
other labels are created at start-up, so they export 0 before the first request
(dashboards and alerts then see the server, not an absent series).

KV-pool use, preemptions and the session-cache series come from the engine's `StepStats`
too; with `--session-mode off` the session series stay 0.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.wire import RequestOutput, StepStats
from scheduler.sessions import SESSION_KINDS

PREFIX = "specserve:"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._define_serving_metrics()
        self._define_spec_metrics()
        self._define_session_metrics()
        self._export_zero_series()

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, ("model_name", *labels), registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, ("model_name",), registry=self.registry)

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(PREFIX + name, doc, ("model_name",), buckets=LATENCY_BUCKETS_S, registry=self.registry)

    def _define_serving_metrics(self) -> None:
        self.num_requests_running = self._gauge("num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = self._gauge("num_requests_waiting", "Requests queued for admission")
        self.engine_healthy = self._gauge("engine_healthy", "1 while the engine process is ready and alive")
        self.engine_restarts = self._counter("engine_restarts_total", "Engine processes started again after one died")
        self.engine_deaths = self._counter(
            "engine_deaths_total", "Engine processes that died, by cause (error, signal, exit, wedged, start_timeout)",
            ("cause",),
        )
        self.ttft = self._histogram("time_to_first_token_seconds", "Seconds from submission to the first token")
        self.itl = self._histogram("inter_token_latency_seconds", "Seconds between consecutive output tokens")
        self.e2e = self._histogram("e2e_request_latency_seconds", "Seconds from submission to the last token")
        self.prompt_tokens = self._counter("prompt_tokens_total", "Prompt tokens of finished requests")
        self.generation_tokens = self._counter("generation_tokens_total", "Generated tokens")
        self.requests = self._counter(
            "request_success_total", "Finished requests by finish reason", ("finished_reason",)
        )
        self.step_seconds = self._histogram("engine_step_seconds", "Seconds per engine step")
        self.kv_cache_usage = self._gauge("kv_cache_usage_perc", "Fraction (0 to 1) of the paged KV pool in use")
        self.preemptions = self._counter("num_preemptions_total", "Running requests sent back to the queue")

    def _define_spec_metrics(self) -> None:
        d = ("drafter",)
        self.num_drafts = self._counter("spec_decode_num_drafts_total", "Verification rounds with drafted tokens", d)
        self.num_draft_tokens = self._counter("spec_decode_num_draft_tokens_total", "Drafted tokens verified", d)
        self.num_accepted = self._counter("spec_decode_num_accepted_tokens_total", "Drafted tokens accepted", d)
        self.accepted_per_pos = self._counter(
            "spec_decode_num_accepted_tokens_per_pos_total", "Accepted drafted tokens by draft position",
            ("drafter", "position"),
        )
        self.offered = self._counter("spec_decode_num_offered_tokens_total", "Drafted tokens the drafters proposed")
        self.verified = self._counter(
            "spec_decode_num_verified_tokens_total", "Drafted tokens the planner sent to verification"
        )
        self.lookahead_rows = self._counter(
            "spec_decode_num_lookahead_rows_total", "Look-ahead rows the planner let drafters add (SPECTRA's pool)"
        )
        self.planned_tokens = self._counter(
            "planner_expected_tokens_total", "Tokens the goodput planner expected its steps to yield"
        )
        self.planned_seconds = self._counter(
            "planner_predicted_seconds_total", "Forward seconds the latency model predicted"
        )
        self.step_tokens = self._counter("engine_step_tokens_total", "Tokens the engine's steps yielded")
        self.acceptance_calibration = Gauge(
            PREFIX + "planner_acceptance_calibration", "Factor the planner multiplies a drafter's acceptance estimates "
            "by: what the tokens it verified accepted over what they were estimated at (1: estimates right)",
            ("model_name", "drafter", "decoding"), registry=self.registry,
        )

    def _define_session_metrics(self) -> None:
        self.session_hits = self._counter("session_cache_hits_total", "Requests that found their session cached")
        self.session_misses = self._counter("session_cache_misses_total", "Requests that found no cached session")
        self.session_reused_tokens = self._counter(
            "session_cache_reused_prefix_tokens_total",
            "Prompt tokens whose KV came from a cached session (prefill saved)",
        )
        self.session_evictions = self._counter("session_cache_evictions_total", "Cached sessions evicted")
        self.conversation_hits = self._counter(
            "session_hits_total", "Later turns of conversations continued from this replica's session cache, by kind "
            "(explicit: named by X-Session-ID or session_id; implicit: matched by prompt prefix)", ("kind",),
        )
        self.conversation_misses = self._counter(
            "session_misses_total", "Later turns of conversations that found no cached session here, by kind",
            ("kind",),
        )
        self.num_sessions = self._gauge("session_cache_num_sessions", "Sessions held in the session cache")
        self.drafter_state_bytes = self._gauge(
            "drafter_state_bytes",
            "Memory of drafter states (hidden states, indexes) of live requests and cached sessions",
        )
        self.session_host_bytes = self._gauge(
            "session_host_bytes",
            "Host memory of cached sessions: token histories, block lists and their drafter states",
        )

    def _export_zero_series(self) -> None:
        """Create every series that has no label besides model_name, so it exports 0 from the start."""
        m = self.model_name
        for metric in (
            self.num_requests_running, self.num_requests_waiting, self.engine_healthy, self.engine_restarts,
            self.kv_cache_usage, self.preemptions, self.ttft, self.itl, self.e2e, self.step_seconds,
            self.prompt_tokens, self.generation_tokens,
            self.offered, self.verified, self.lookahead_rows, self.planned_tokens, self.planned_seconds,
            self.step_tokens,
            self.session_hits, self.session_misses, self.session_reused_tokens, self.session_evictions,
            self.num_sessions, self.drafter_state_bytes, self.session_host_bytes,
        ):
            metric.labels(m)
        for kind in SESSION_KINDS:
            self.conversation_hits.labels(m, kind)
            self.conversation_misses.labels(m, kind)

    # --- engine steps -------------------------------------------------------------------
    def observe_step(self, stats: StepStats) -> None:
        m = self.model_name
        self.num_requests_running.labels(m).set(stats.num_running)
        self.num_requests_waiting.labels(m).set(stats.num_waiting)
        if stats.step_seconds:
            self.step_seconds.labels(m).observe(stats.step_seconds)
        self.offered.labels(m).inc(stats.num_offered_draft_tokens)
        self.verified.labels(m).inc(stats.num_verified_draft_tokens)
        self.lookahead_rows.labels(m).inc(stats.num_lookahead_rows)
        self.planned_tokens.labels(m).inc(stats.planned_tokens)
        self.planned_seconds.labels(m).inc(stats.planned_seconds)
        self.step_tokens.labels(m).inc(stats.num_generated_tokens)
        self._observe_cache_stats(stats)
        for drafter, spec in stats.spec_by_drafter.items():
            self.num_drafts.labels(m, drafter).inc(spec.num_drafts)
            self.num_draft_tokens.labels(m, drafter).inc(spec.num_draft_tokens)
            self.num_accepted.labels(m, drafter).inc(spec.num_accepted_tokens)
            for position, count in enumerate(spec.num_accepted_per_position):
                self.accepted_per_pos.labels(m, drafter, str(position)).inc(count)
        for drafter, factors in stats.acceptance_calibration.items():
            for decoding, factor in factors.items():
                self.acceptance_calibration.labels(m, drafter, decoding).set(factor)

    def _observe_cache_stats(self, stats: StepStats) -> None:
        """KV-pool, preemption and session-cache fields."""
        m = self.model_name
        self.kv_cache_usage.labels(m).set(stats.kv_cache_usage)
        self.preemptions.labels(m).inc(stats.num_preemptions)
        self.session_hits.labels(m).inc(stats.session_hits)
        self.session_misses.labels(m).inc(stats.session_misses)
        self.session_reused_tokens.labels(m).inc(stats.session_reused_tokens)
        self.session_evictions.labels(m).inc(stats.session_evictions)
        for kind, count in stats.conversation_hits.items():
            self.conversation_hits.labels(m, kind).inc(count)
        for kind, count in stats.conversation_misses.items():
            self.conversation_misses.labels(m, kind).inc(count)
        self.num_sessions.labels(m).set(stats.num_sessions)
        self.drafter_state_bytes.labels(m).set(stats.drafter_state_bytes)
        self.session_host_bytes.labels(m).set(stats.session_host_bytes)

    def set_engine_healthy(self, healthy: bool) -> None:
        self.engine_healthy.labels(self.model_name).set(1 if healthy else 0)

    def engine_died(self, cause: str) -> None:
        self.set_engine_healthy(False)
        self.engine_deaths.labels(self.model_name, cause).inc()

    def engine_restarted(self) -> None:
        self.engine_restarts.labels(self.model_name).inc()

    def request_timer(self) -> "RequestTimer":
        return RequestTimer(self)


class RequestTimer:
    """Latencies of one request, observed as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.submitted = time.monotonic()  # seconds
        self.last_output: float | None = None

    def on_output(self, output: RequestOutput) -> None:
        m, now, num_new = self.metrics.model_name, time.monotonic(), len(output.new_token_ids)
        if num_new:
            if self.last_output is None:
                self.metrics.ttft.labels(m).observe(now - self.submitted)
            else:
                for _ in range(num_new):  # tokens verified together arrive together: spread the interval
                    self.metrics.itl.labels(m).observe((now - self.last_output) / num_new)
            self.last_output = now
            self.metrics.generation_tokens.labels(m).inc(num_new)
        if output.finish_reason:
            self.metrics.e2e.labels(m).observe(now - self.submitted)
            self.metrics.prompt_tokens.labels(m).inc(output.num_prompt_tokens)
            self.metrics.requests.labels(m, output.finish_reason).inc()
