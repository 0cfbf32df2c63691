"""deploy/k8s renders with kustomize, and the rendered objects validate offline: the built-in kinds against the
Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields fail) of the oldest and newest versions it
ships; the prometheus-operator kinds against tests/deploy/crd_schemas.py; and the objects point at each other
(selectors, named ports, probe paths, scale target, the metric the autoscaler reads, the router's discovery of the
replicas and its permission to watch them)."""
from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils
from packaging.version import Version

from bench.replicas import ROUTER_FLAGS
from server.config import ServerConfig
from server.drain import CLOSE_GRACE_S
from tests.deploy.crd_schemas import CRD_SCHEMAS
from tests.deploy.tools import RULES, flag_values, render_k8s

ROUTER = "specserve-router"  # the router's objects' name (deploy/k8s/router.yaml)
# the rendered objects: the replicas' by their kind, the router's as KIND/NAME (tests/deploy/tools.py)
BUILT_IN = ["Deployment", "Service", "Ingress", "HorizontalPodAutoscaler",
            *(f"{kind}/{ROUTER}" for kind in ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"))]
CRDS = ["ServiceMonitor", "PrometheusRule", f"ServiceMonitor/{ROUTER}"]
VERSIONS = (min(kv_utils.all_versions(), key=Version), kv_utils.latest_version())


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    by_key = render_k8s()
    assert set(by_key) == {*BUILT_IN, *CRDS}
    return by_key


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("key", BUILT_IN)
def test_built_in_kinds_validate_against_the_kubernetes_schemas(rendered, key, version):
    kubernetes_validate.validate(rendered[key], version, strict=True)  # raises ValidationError


@pytest.mark.parametrize("key", CRDS)
def test_prometheus_operator_kinds_validate_against_their_crd_schemas(rendered, key):
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # no schema there: ours is needed
        kubernetes_validate.validate(rendered[key], VERSIONS[-1], strict=True)
    obj = rendered[key]
    jsonschema.validate(obj, CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])])


def pod_labels(rendered) -> dict:
    return rendered["Deployment"]["spec"]["template"]["metadata"]["labels"]


def container(rendered) -> dict:
    (only,) = rendered["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


def test_deployment_selects_its_pods_requests_a_gpu_and_probes_health(rendered):
    spec = rendered["Deployment"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels(rendered).items()
    c = container(rendered)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    port_names = {p["name"] for p in c["ports"]}
    paths = {probe: c[probe]["httpGet"]["path"] for probe in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert paths == {
        "startupProbe": "/health/ready",
        "readinessProbe": "/health/ready",
        "livenessProbe": "/health/live",
    }
    assert all(c[probe]["httpGet"]["port"] in port_names for probe in paths)
    assert spec["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_the_pod_gets_time_to_drain(rendered):
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in container(rendered)["env"]}
    drain_s = float(env.get("SPECSERVE_DRAIN_TIMEOUT") or ServerConfig.drain_timeout_s)
    pre_stop_s = float(container(rendered)["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + drain_s + CLOSE_GRACE_S


def test_service_reaches_the_pods_and_the_service_monitor_scrapes_it(rendered):
    service = rendered["Service"]
    assert service["spec"]["selector"].items() <= pod_labels(rendered).items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= {p["name"] for p in container(rendered)["ports"]}
    monitor = rendered["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert all(e["path"] == "/metrics" for e in monitor["endpoints"])


def router_container(rendered) -> dict:
    (router,) = rendered[f"Deployment/{ROUTER}"]["spec"]["template"]["spec"]["containers"]
    return router


def router_args(rendered) -> dict[str, str]:
    return flag_values(router_container(rendered)["args"])


def test_ingress_sends_clients_to_the_router_and_the_router_service_reaches_its_pod(rendered):
    ingress = rendered["Ingress"]
    backends = [p["backend"]["service"] for r in ingress["spec"]["rules"] for p in r["http"]["paths"]]
    service = rendered[f"Service/{ROUTER}"]
    assert backends and all(b["name"] == service["metadata"]["name"] for b in backends)
    assert {b["port"]["name"] for b in backends} <= {p["name"] for p in service["spec"]["ports"]}
    router_pod = rendered[f"Deployment/{ROUTER}"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= router_pod["metadata"]["labels"].items()
    (router,) = router_pod["spec"]["containers"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {p["name"] for p in router["ports"]}
    monitor = rendered[f"ServiceMonitor/{ROUTER}"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["endpoints"]] == ["metrics"]
    assert router_args(rendered)["--prometheus-port"] == str(next(p["containerPort"] for p in router["ports"]
                                                               if p["name"] == "metrics"))


def test_the_router_discovers_the_replicas_pods_and_may_watch_them(rendered):
    flags = router_args(rendered)
    key, _, value = flags["--selector"].partition("=")
    assert pod_labels(rendered)[key] == value  # it finds the replicas' pods, and only theirs
    assert rendered[f"Deployment/{ROUTER}"]["spec"]["template"]["metadata"]["labels"].get(key) != value
    assert flags["--service-discovery-port"] == str(container(rendered)["ports"][0]["containerPort"])
    assert flag_values(ROUTER_FLAGS).items() <= flag_values(router_container(rendered)["args"]).items()
    binding = rendered[f"RoleBinding/{ROUTER}"]
    pod_spec = rendered[f"Deployment/{ROUTER}"]["spec"]["template"]["spec"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod_spec["serviceAccountName"]}]
    (rule,) = rendered[binding["roleRef"]["kind"] + "/" + binding["roleRef"]["name"]]["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])


def test_autoscaler_scales_the_deployment_on_queue_depth(rendered):
    hpa = rendered["HorizontalPodAutoscaler"]["spec"]
    deployment = rendered["Deployment"]
    assert hpa["scaleTargetRef"] == {"apiVersion": deployment["apiVersion"], "kind": "Deployment",
                                     "name": deployment["metadata"]["name"]}
    (metric,) = hpa["metrics"]
    # prometheus-adapter exposes specserve:num_requests_waiting under this name (':' is not allowed there)
    assert metric["pods"]["metric"]["name"] == "specserve_num_requests_waiting"


def test_prometheus_rule_carries_the_alert_rules_file(rendered):
    assert rendered["PrometheusRule"]["spec"] == yaml.safe_load(RULES.read_text())
