"""The Grafana dashboard, read without Prometheus: it has the panels the issue asks for, and every metric its
queries use is one that server/metrics.py exports (tests/deploy/test_live_prometheus.py runs the queries)."""
from __future__ import annotations

import json

import pytest
import yaml

from engine.wire import DraftStepStats, RequestOutput, StepStats
from server.metrics import ServerMetrics
from tests.deploy.dashboards import metric_names, panel_queries, panels
from tests.deploy.tools import COMPOSE, COMPOSE_REPLICAS, DASHBOARDS, REPO

REQUIRED_METRICS = {  # what the dashboard must show, by the metric that shows it
    "throughput": "specserve:generation_tokens_total",
    "TTFT": "specserve:time_to_first_token_seconds_bucket",
    "inter-token latency": "specserve:inter_token_latency_seconds_bucket",
    "end-to-end latency": "specserve:e2e_request_latency_seconds_bucket",
    "running requests": "specserve:num_requests_running",
    "queued requests": "specserve:num_requests_waiting",
    "KV cache use": "specserve:kv_cache_usage_perc",
    "session-cache hits": "specserve:session_cache_hits_total",
    "session-cache reused tokens": "specserve:session_cache_reused_prefix_tokens_total",
    "sessions cached": "specserve:session_cache_num_sessions",
}
SPECULATION_PANELS = {  # the speculation row: panel title -> metrics its queries combine
    "Acceptance rate by drafter": {
        "specserve:spec_decode_num_accepted_tokens_total",
        "specserve:spec_decode_num_draft_tokens_total",
    },
    "Mean acceptance length by drafter": {
        "specserve:spec_decode_num_accepted_tokens_total",
        "specserve:spec_decode_num_drafts_total",
    },
    "Acceptance by draft position": {
        "specserve:spec_decode_num_accepted_tokens_per_pos_total",
        "specserve:spec_decode_num_drafts_total",
    },
    "Copied fraction of generated tokens": {
        "specserve:spec_decode_num_accepted_tokens_total",
        "specserve:generation_tokens_total",
    },
    "Goodput: estimated vs achieved": {
        "specserve:planner_expected_tokens_total",
        "specserve:planner_predicted_seconds_total",
        "specserve:engine_step_tokens_total",
        "specserve:engine_step_seconds_sum",
    },
}


def exported_names() -> set[str]:
    """Every sample name ServerMetrics exports once a step with a drafter and a finished request went through."""
    metrics = ServerMetrics("m")
    spec = DraftStepStats(num_drafts=1, num_draft_tokens=2, num_accepted_tokens=1, num_accepted_per_position=[1])
    metrics.observe_step(StepStats(step_seconds=0.01, spec_by_drafter={"copyspec": spec}))
    timer = metrics.request_timer()
    timer.on_output(RequestOutput("r", [1]))
    timer.on_output(RequestOutput("r", [2], finish_reason="stop", num_prompt_tokens=3))
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}


def test_every_dashboard_metric_is_exported():
    assert DASHBOARDS, "no dashboard under deploy/grafana/dashboards"
    exported = exported_names()
    for query in panel_queries():
        assert metric_names(query.expr), f"query names no specserve metric: {query}"
        assert metric_names(query.expr) <= exported, f"{query}: {metric_names(query.expr) - exported} not exported"


def test_dashboard_shows_serving_kv_and_session_metrics():
    used = set().union(*(metric_names(q.expr) for q in panel_queries()))
    missing = {what: name for what, name in REQUIRED_METRICS.items() if name not in used}
    assert not missing, f"dashboard lacks {missing}"


def test_speculation_row_has_its_panels_per_drafter():
    dashboard = json.loads((REPO / "deploy/grafana/dashboards/specserve.json").read_text())
    all_panels = panels(dashboard)
    titles = [p["title"] for p in all_panels]
    row = titles.index("Speculation")
    for title, needed in SPECULATION_PANELS.items():
        assert title in titles[row:], f"speculation row lacks {title!r}"
        panel = all_panels[titles.index(title)]
        assert needed <= set().union(*(metric_names(t["expr"]) for t in panel["targets"])), title
    for title in ("Acceptance rate by drafter", "Mean acceptance length by drafter", "Acceptance by draft position"):
        target = all_panels[titles.index(title)]["targets"][0]
        assert "drafter" in target["expr"] and "{{drafter}}" in target["legendFormat"], title


def test_queries_filter_on_the_model_variable_and_use_the_rate_interval():
    for query in panel_queries():
        assert 'model_name=~"$model_name"' in query.expr, query
        assert "[$__rate_interval]" in query.expr or "rate(" not in query.expr, query


@pytest.mark.parametrize("compose", [COMPOSE, COMPOSE_REPLICAS], ids=lambda path: path.name)
def test_compose_provisions_the_dashboards_and_the_datasource(compose):
    grafana = yaml.safe_load(compose.read_text())["services"]["grafana"]
    mounts = dict(volume.rsplit(":", 2)[:2] for volume in grafana["volumes"])
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/specserve.yaml").read_text())
    assert mounts["../deploy/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    assert mounts["../deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    datasources = REPO / "deploy/grafana/provisioning/datasources/prometheus.yaml"
    datasource = yaml.safe_load(datasources.read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
