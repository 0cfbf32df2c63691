"""Faults the server survives without outside help, against a real server on loopback: its engine process killed
mid-stream, its engine wedged (stopped) mid-stream, too many deaths in a row, and the test run itself killed.

The probes read are the rendered Kubernetes manifests' own paths, so the manifests are checked against a live
server: liveness stays green while an engine restarts, readiness does not.
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import httpx
import pytest

from bench.server_process import start_server, stop_server
from tests.deploy.tools import render_k8s
from tests.reliability.helpers import LONG_STREAM, SHORT, pid_alive, status, stream_until_it_ends, wait_for

FAIL_FAST_S = 2.0  # in-flight requests fail, and readiness turns red, within this of the engine's death
RECOVER_S = 60.0  # a new engine serves within this


def probe_paths() -> tuple[str, str]:
    (container,) = render_k8s()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container["livenessProbe"]["httpGet"]["path"], container["readinessProbe"]["httpGet"]["path"]


def break_engine_mid_stream(server, sig: int) -> tuple[str, float, bool]:
    """Stream a long answer, send SIG to the engine after the first chunks: (the stream's rest, seconds until the
    stream ended, counted from the signal, and whether readiness went red within FAIL_FAST_S)."""
    _, ready = probe_paths()
    engine = server.engine_pid()
    with httpx.stream("POST", server.api_url + "/chat/completions", json=LONG_STREAM, timeout=120) as response:
        assert response.status_code == 200
        rest, ended_s = stream_until_it_ends(response, lambda: os.kill(engine, sig))
    red = wait_for(lambda: status(server.base_url, ready) == 503, FAIL_FAST_S)
    return rest, ended_s, red


def socket_files() -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), "specserve-*"))


def recover(server, dead_engine: int, sockets_before: int) -> set[tuple[int | None, int | None]]:
    """Wait until readiness is green again; every (liveness, readiness) pair seen meanwhile."""
    live, ready = probe_paths()
    seen = set()

    def ready_again() -> bool:
        seen.add((status(server.base_url, live), status(server.base_url, ready)))
        return status(server.base_url, ready) == 200

    assert wait_for(ready_again, RECOVER_S, interval_s=0.2), f"no engine within {RECOVER_S} s:\n{server.log()}"
    assert not pid_alive(dead_engine) and server.engine_pids() == [server.engine_pid()], "a leaked engine"
    assert wait_for(lambda: len(socket_files()) == sockets_before, 5), "the dead engine's ipc files stayed"
    answer = httpx.post(server.api_url + "/chat/completions", json=SHORT, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    return seen


@pytest.mark.slow
def test_a_killed_or_wedged_engine_is_replaced_and_too_many_deaths_stop_the_server(tmp_path):
    server = start_server(tmp_path, "--drafter", "none", "--engine-stall-timeout", "3", "--engine-max-restarts", "2")
    try:
        # 1. SIGKILL mid-stream (a crash, an OOM kill)
        engine, sockets = server.engine_pid(), len(socket_files())
        rest, ended_s, red = break_engine_mid_stream(server, signal.SIGKILL)
        assert '"error"' in rest and "engine" in rest and rest.rstrip().endswith("data: [DONE]")
        assert ended_s < FAIL_FAST_S and red, (ended_s, red)
        seen = recover(server, engine, sockets)
        assert (200, 503) in seen and {live for live, _ in seen} == {200}, seen  # live throughout, not ready meanwhile
        health = httpx.get(server.base_url + "/health").json()
        assert health["engine_restarts"] == 1 and "SIGKILL" in health["last_engine_exit"]

        # 2. a wedge: the engine stops answering (SIGSTOP) with a request in flight; the stall bound is 3 s
        engine = server.engine_pid()
        rest, ended_s, _ = break_engine_mid_stream(server, signal.SIGSTOP)
        assert '"error"' in rest and ended_s < 3 + FAIL_FAST_S, ended_s
        recover(server, engine, sockets)
        health = httpx.get(server.base_url + "/health").json()
        assert health["engine_restarts"] == 2 and health["last_engine_exit"].startswith("wedged")
        metrics = httpx.get(server.base_url + "/metrics").text
        assert 'specserve:engine_restarts_total{model_name="SmolLM2-135M-Instruct"} 2.0' in metrics
        assert 'cause="signal"' in metrics and 'cause="wedged"' in metrics

        # 3. a third death within the window is one more than 2 restarts allow: the server exits 1
        os.kill(server.engine_pid(), signal.SIGKILL)
        assert server.process.wait(timeout=30) == 1
        assert "died too often" in server.log()
    finally:
        stop_server(server)


LAUNCHER = """
    import sys, time
    from pathlib import Path
    from bench.server_process import start_server
    server = start_server(Path(sys.argv[1]), "--drafter", "none")
    print(server.process.pid, server.engine_pid(), flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_servers_die_with_the_test_run_that_started_them(tmp_path):
    """A test run killed outright (SIGKILL: no fixture teardown runs) leaves no server and no engine behind."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(LAUNCHER), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        server_pid, engine_pid = map(int, launcher.stdout.readline().split())
    finally:
        launcher.kill()
        launcher.wait()
    assert wait_for(lambda: not pid_alive(server_pid), 10), "the server outlived the run that started it"
    assert wait_for(lambda: not pid_alive(engine_pid), 10), "the engine outlived its server"
