"""Disconnects free their work; a dead engine turns /health red and fails requests cleanly."""
import os
import signal

import httpx
import pytest

from bench.server_process import start_server, stop_server
from tests.reliability.helpers import pid_alive, wait_for

MODEL = "SmolLM2-135M-Instruct"
LONG_REQUEST = {
    "model": MODEL, "stream": True, "max_tokens": 3000, "temperature": 0.8, "seed": 1,
    "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse keeper."}],
}


def engine_idle(server) -> bool:
    health = httpx.get(server.base_url + "/health", timeout=5).json()
    return health["num_running"] == 0 and health["num_waiting"] == 0


def test_client_disconnect_mid_stream_aborts_the_request(server):
    with httpx.stream("POST", server.api_url + "/chat/completions", json=LONG_REQUEST, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        assert not engine_idle(server)
    # 3000 tokens would take minutes; an abort empties the engine within a few steps
    assert wait_for(lambda: engine_idle(server), deadline_s=20), "the engine kept generating for a gone client"


@pytest.mark.slow
def test_engine_crash_turns_health_red_and_fails_in_flight_requests(tmp_path):
    server = start_server(tmp_path, "--drafter", "none")
    try:
        assert server.health_statuses[0] == 503, "the server listens while the engine loads, and says so"
        with httpx.stream("POST", server.api_url + "/chat/completions", json=LONG_REQUEST, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            os.kill(server.engine_pid(), signal.SIGKILL)
            rest = "\n".join(lines)  # the stream must end, not hang
        assert '"error"' in rest
        health = httpx.get(server.base_url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["message"]
        after = httpx.post(server.api_url + "/chat/completions", json={**LONG_REQUEST, "stream": False}, timeout=30)
        assert after.status_code == 503 and after.json()["error"]["type"]
    finally:
        stop_server(server)


def test_a_missing_model_file_stops_the_server_with_a_clear_message(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "specserve", "serve", "--model", str(tmp_path / "missing.gguf")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "GGUF file not found" in result.stderr


@pytest.mark.slow
def test_the_engine_exits_when_its_server_is_killed(tmp_path):
    server = start_server(tmp_path, "--drafter", "none")
    engine_pid = server.engine_pid()
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=10)

    try:
        assert wait_for(lambda: not pid_alive(engine_pid), deadline_s=15), "an orphaned engine kept running"
    finally:
        try:
            os.killpg(server.process.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
