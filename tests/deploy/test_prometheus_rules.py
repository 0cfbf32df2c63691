"""promtool accepts the alert rules and the compose stack's Prometheus config; the alerts fire when they should;
the Kubernetes PrometheusRule carries exactly the same rules."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.deploy.tools import K8S, PROMETHEUS_DIR, RULES, debian_tool


def promtool(*args: str, cwd=PROMETHEUS_DIR) -> str:
    done = subprocess.run([debian_tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_promtool_accepts_the_alert_rules():
    assert "SUCCESS: 3 rules found" in promtool("check", "rules", str(RULES))


def test_alerts_fire_on_engine_down_queue_growth_and_acceptance_collapse():
    """deploy/prometheus/rules_test.yml: promtool's unit tests, with input series and the alerts expected."""
    assert "SUCCESS" in promtool("test", "rules", "rules_test.yml")


@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus.replicas.yml"])
def test_promtool_accepts_the_compose_prometheus_configs(tmp_path, name):
    """deploy/prometheus's configs (one server; replicas and router) with the rule file where compose mounts it (here:
    next to it)."""
    config = yaml.safe_load((PROMETHEUS_DIR / name).read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules.yml"]  # compose.yaml mounts rules.yml there
    config["rule_files"] = [str(RULES)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    promtool("check", "config", str(tmp_path / "prometheus.yml"))


def test_kubernetes_prometheus_rule_carries_the_same_rules():
    rules = yaml.safe_load(RULES.read_text())
    prometheus_rule = yaml.safe_load((K8S / "prometheusrule.yaml").read_text())
    assert prometheus_rule["spec"] == rules
