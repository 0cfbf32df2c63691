"""The Dockerfiles pass hadolint; each image runs docker/entrypoint.sh, which starts the same `specserve serve`
command line the tests start (bench/server_process.py), with flags from SPECSERVE_* variables; compose wires
the services together, in files that follow the compose specification. Images are not built here (no registry for
base images)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import pytest
import yaml

from bench.replicas import ROUTER_FLAGS
from bench.server_process import specserve_command
from specserve import build_parser
from tests.deploy.tools import (
    COMPOSE,
    COMPOSE_REPLICAS,
    DOCKER,
    DOCKERFILES,
    ENTRYPOINT,
    K8S,
    REPO,
    flag_values,
    venv_tool,
)

IMAGE_ENTRYPOINT = "/usr/local/bin/specserve-entrypoint"
ENV_FLAGS = {  # SPECSERVE_* variable -> (a value, the flag it sets): every variable the entrypoint reads
    "SPECSERVE_MODEL": ("/models/m.gguf", "--model"),
    "SPECSERVE_DRAFTER": ("none", "--drafter"),
    "SPECSERVE_DEVICE": ("cpu", "--device"),
    "SPECSERVE_DTYPE": ("float32", "--dtype"),
    "SPECSERVE_NUM_THREADS": ("2", "--num-threads"),
    "SPECSERVE_MAX_MODEL_LEN": ("2048", "--max-model-len"),
    "SPECSERVE_MAX_NUM_SEQS": ("4", "--max-num-seqs"),
    "SPECSERVE_MAX_WAITING": ("64", "--max-waiting"),
    "SPECSERVE_MAX_NUM_BATCHED_TOKENS": ("256", "--max-num-batched-tokens"),
    "SPECSERVE_KV_CACHE_MEMORY": ("1.5", "--kv-cache-memory"),
    "SPECSERVE_ATTENTION_BACKEND": ("sdpa", "--attention-backend"),
    "SPECSERVE_SERVED_MODEL_NAME": ("smol", "--served-model-name"),
    "SPECSERVE_SESSION_MODE": ("explicit", "--session-mode"),
    "SPECSERVE_SESSION_TTL": ("120", "--session-ttl"),
    "SPECSERVE_MAX_SESSIONS": ("64", "--max-sessions"),
    "SPECSERVE_DRAIN_TIMEOUT": ("20", "--drain-timeout"),
    "SPECSERVE_ENGINE_START_TIMEOUT": ("1800", "--engine-start-timeout"),
    "SPECSERVE_ENGINE_MAX_RESTARTS": ("3", "--engine-max-restarts"),
}


def entrypoint_argv(tmp_path, env: dict[str, str], *args: str) -> list[str]:
    """What docker/entrypoint.sh hands to `specserve`, caught by a stand-in that prints its arguments."""
    fake = tmp_path / "specserve"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")}
    done = subprocess.run(
        ["sh", str(ENTRYPOINT), *args],
        env={**clean, **env, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.splitlines()


def instructions(dockerfile) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")),
    )
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def compose_spec_findings(path) -> subprocess.CompletedProcess:
    return subprocess.run([venv_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("compose", [COMPOSE, COMPOSE_REPLICAS], ids=lambda path: path.name)
def test_compose_file_follows_the_compose_specification(compose):
    """Docker Compose itself is not installed here: the file is checked against the specification's schema."""
    checked = compose_spec_findings(compose)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_compose_check_finds_a_broken_file(tmp_path):
    broken = yaml.safe_load(COMPOSE_REPLICAS.read_text())
    broken["services"]["router"]["restart_policy"] = "always"  # not a service key (it belongs under deploy:)
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    assert compose_spec_findings(path).returncode != 0


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    """Every hadolint finding fails (default threshold: info); rules ignored inline say why."""
    done = subprocess.run(
        [venv_tool("hadolint"), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_entrypoint_runs_the_command_the_tests_start(tmp_path):
    port = 8123
    env = {"SPECSERVE_HOST": "127.0.0.1", "SPECSERVE_PORT": str(port), "SPECSERVE_DRAFTER": "copyspec"}
    tests_command = specserve_command(port, "--drafter", "copyspec")
    assert tests_command[1:4] == ["-m", "specserve", "serve"]
    assert entrypoint_argv(tmp_path, env) == tests_command[3:]  # the entrypoint execs the `specserve` script...
    script = re.search(r'^specserve = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    # ...which is specserve's main, as `python -m specserve` runs it
    assert script and script.group(1) == "specserve:main"


def test_entrypoint_defaults_listen_on_all_interfaces_port_8000(tmp_path):
    assert entrypoint_argv(tmp_path, {}) == ["serve", "--host", "0.0.0.0", "--port", "8000"]


def test_every_specserve_variable_sets_a_flag_that_specserve_serve_accepts(tmp_path):
    env = {name: value for name, (value, _) in ENV_FLAGS.items()}
    argv = entrypoint_argv(tmp_path, env, "--copy-gamma", "4")
    for name, (value, flag) in ENV_FLAGS.items():
        assert argv[argv.index(flag) + 1] == value, name
    assert argv[-2:] == ["--copy-gamma", "4"]  # `docker run IMAGE ARGS...` appends flags
    build_parser().parse_args(argv)  # exits on an unknown flag or a bad value
    read = set(re.findall(r"\bSPECSERVE_[A-Z_]+", ENTRYPOINT.read_text()))
    assert read == set(ENV_FLAGS) | {"SPECSERVE_HOST", "SPECSERVE_PORT", "SPECSERVE_API_KEY"}


def test_the_deployment_guide_documents_every_specserve_variable():
    guide = (REPO / "docs" / "deployment.md").read_text()
    for name in set(ENV_FLAGS) | {"SPECSERVE_HOST", "SPECSERVE_PORT", "SPECSERVE_API_KEY"}:
        assert f"`{name}`" in guide, name


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_the_entrypoint_as_a_non_root_user_with_a_health_check(dockerfile):
    steps = instructions(dockerfile)
    assert ("COPY", f"docker/entrypoint.sh {IMAGE_ENTRYPOINT}") in steps
    entrypoints = [json.loads(args) for kind, args in steps if kind == "ENTRYPOINT"]
    assert entrypoints == [[IMAGE_ENTRYPOINT]] and not [s for s in steps if s[0] == "CMD"]
    users = [args for kind, args in steps if kind == "USER"]
    assert users and users[-1].isdigit() and int(users[-1]) != 0  # numeric, so runAsNonRoot can check it
    (health,) = [args for kind, args in steps if kind == "HEALTHCHECK"]
    assert "/health" in health and "SPECSERVE_PORT" in health
    assert ("EXPOSE", "8000") in steps
    assert os.access(ENTRYPOINT, os.X_OK)
    subprocess.run(["sh", "-n", str(ENTRYPOINT)], check=True)


def test_kubernetes_deployment_sets_only_variables_the_entrypoint_reads():
    deployment = yaml.safe_load((K8S / "deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    read = set(re.findall(r"\bSPECSERVE_[A-Z_]+", ENTRYPOINT.read_text()))
    assert {e["name"] for e in container["env"]} <= read
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001
    assert "args" not in container and "command" not in container  # the image's entrypoint runs unchanged


def test_compose_builds_the_cpu_image_and_prometheus_scrapes_it():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert (DOCKER / services["specserve"]["build"]["context"] / services["specserve"]["build"]["dockerfile"]).exists()
    for service in services.values():
        for volume in service.get("volumes", []):
            assert (DOCKER / volume.split(":")[0]).exists(), volume
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    (target,) = config["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target == "specserve:8000" and "127.0.0.1:8000:8000" in services["specserve"]["ports"]
    assert shlex.split(" ".join(services["prometheus"]["command"]))[0] == "--config.file=/etc/prometheus/prometheus.yml"


def test_the_replicas_compose_puts_the_router_in_front_of_every_replica_and_prometheus_scrapes_them_all():
    services = yaml.safe_load(COMPOSE_REPLICAS.read_text())["services"]
    replicas = sorted(name for name in services if name.startswith("replica-"))
    assert len(replicas) == 3
    router = services["router"]
    assert router["entrypoint"] == ["smg", "launch"] and "127.0.0.1:8000:8000" in router["ports"]
    assert router["image"] == services[replicas[0]]["image"]  # the image brings smg (the router extra)
    assert all("ports" not in services[name] for name in replicas)  # reached through the router only
    workers = router["command"][router["command"].index("--worker-urls") + 1:]
    assert workers == [f"http://{name}:8000" for name in replicas]
    assert flag_values(ROUTER_FLAGS).items() <= flag_values(router["command"]).items()  # the flags measured
    for service in services.values():
        for volume in service.get("volumes", []):
            assert (DOCKER / volume.split(":")[0]).exists(), volume
    mounted = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"])
    config = yaml.safe_load((DOCKER / next(k for k, v in mounted.items() if v == "/etc/prometheus/prometheus.yml"))
                            .read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    port = next(a for a in router["command"] if a.startswith("--prometheus-port=")).split("=")[1]
    assert targets == {"specserve": [f"{name}:8000" for name in replicas], "router": [f"router:{port}"]}

