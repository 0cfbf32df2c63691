"""A real Prometheus (Debian's package) scrapes a real specserve on loopback, started through docker/entrypoint.sh
as the images start it, under a short load with the copyspec drafter; then every query of every dashboard panel
returns data (at least one series with a finite value), and the alert rules load and evaluate."""
from __future__ import annotations

import math
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from bench.server_process import free_port, start_process, stop_server
from tests.deploy.dashboards import panel_queries
from tests.deploy.tools import ENTRYPOINT, RULES, VENV_BIN, debian_tool, poll_until

pytestmark = pytest.mark.slow
SCRAPE_INTERVAL = "1s"
MIN_REQUESTS = 4  # completions before the dashboard's queries are checked; the load goes on until they pass
MAX_REQUESTS = 16
PROMPT = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def specserve(tmp_path_factory):
    """specserve as the images run it: docker/entrypoint.sh with SPECSERVE_* variables, the venv's `specserve`.

    --no-goodput-planner (a container argument) verifies every drafted token: on a busy CPU the planner may
    verify none, and the speculation row would have nothing to show."""
    assert (VENV_BIN / "specserve").exists(), f"no specserve script in {VENV_BIN}: run make setup"
    port = free_port()
    command = ["env", "-u", "SPECSERVE_API_KEY", f"PATH={VENV_BIN}:{os.environ['PATH']}", "SPECSERVE_HOST=127.0.0.1",
               f"SPECSERVE_PORT={port}", "SPECSERVE_DRAFTER=copyspec", "SPECSERVE_MAX_NUM_SEQS=4",
               "sh", str(ENTRYPOINT), "--no-goodput-planner"]
    server = start_process(command, port, tmp_path_factory.mktemp("specserve"))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def prometheus(specserve, tmp_path_factory):
    """Prometheus on a free loopback port with a temporary config and storage, scraping specserve every second."""
    binary = debian_tool("prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "specserve", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [specserve.base_url.removeprefix("http://")]}]}],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with open(workdir / "prometheus.log", "w") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        poll_until(lambda: ready(process, base_url, workdir), 60, "Prometheus ready")
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def ready(process: subprocess.Popen, base_url: str, workdir) -> bool | None:
    if process.poll() is not None:
        raise RuntimeError(f"prometheus exited with {process.returncode}:\n{(workdir / 'prometheus.log').read_text()}")
    try:
        return True if httpx.get(base_url + "/-/ready", timeout=2).status_code == 200 else None
    except httpx.TransportError:
        return None


def query(base_url: str, promql: str) -> list[dict]:
    reply = httpx.get(base_url + "/api/v1/query", params={"query": promql}, timeout=10).json()
    assert reply["status"] == "success", (promql, reply)
    return reply["data"]["result"]


def has_data(series: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in series)


class Load:
    """Chat completions from two client threads until stopped (or MAX_REQUESTS), counting the finished ones."""

    def __init__(self, api_url: str) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=api_url, api_key="unused", max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id
        self.stop = threading.Event()
        self.replies: list = []
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stop.is_set() and len(self.replies) < MAX_REQUESTS:
            reply = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=32, temperature=0)
            with self.lock:
                self.replies.append(reply)

    def drafted_tokens(self) -> int:
        return sum(r.model_extra["spec_stats"]["drafted_tokens"] for r in self.replies)


def failing_queries(base_url: str, model_name: str) -> list[str]:
    return [str(q) for q in panel_queries() if not has_data(query(base_url, q.promql(model_name)))]


def test_every_dashboard_query_returns_data_under_load(specserve, prometheus):
    poll_until(lambda: query(prometheus, 'up{job="specserve"} == 1') or None, 30, "Prometheus scraping specserve")
    load = Load(specserve.api_url)
    with ThreadPoolExecutor(2) as pool:
        workers = [pool.submit(load.run) for _ in range(2)]
        try:
            poll_until(lambda: True if len(load.replies) >= MIN_REQUESTS or any(w.done() for w in workers) else None,
                       180, f"{MIN_REQUESTS} chat completions")
            for worker in (w for w in workers if w.done()):
                worker.result()  # a worker stops early only when a request failed: re-raise it
            try:
                poll_until(lambda: None if failing_queries(prometheus, load.model) else True, 60,
                           "every dashboard query returning data", interval_s=1.0)
            except TimeoutError:
                pytest.fail("dashboard queries without data:\n" + "\n".join(failing_queries(prometheus, load.model)))
        finally:
            load.stop.set()
        for worker in workers:
            worker.result()  # re-raises a failed request
    assert load.drafted_tokens() > 0, "copyspec drafted nothing: the speculation row had nothing to show"


def test_alert_rules_load_and_evaluate_without_firing(prometheus):
    """The rules load from deploy/prometheus/rules.yml and evaluate cleanly; with specserve healthy none fires."""
    def rules() -> list[dict]:
        groups = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]

    def quiet(rule: dict) -> bool:
        return rule["health"] == "ok" and not rule["lastEvaluation"].startswith("0001") and rule["state"] == "inactive"

    assert {r["name"] for r in rules()} == {
        "SpecserveEngineDown",
        "SpecserveQueueGrowing",
        "SpecserveAcceptanceCollapse",
    }
    try:  # the first evaluation may precede the first scrape, when SpecserveEngineDown's absent() holds
        poll_until(lambda: True if all(quiet(r) for r in rules()) else None, 30, "alert rules evaluated and inactive")
    except TimeoutError:
        pytest.fail(f"alert rules: {[(r['name'], r['health'], r['state'], r.get('lastError')) for r in rules()]}")
