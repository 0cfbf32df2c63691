"""SIGTERM drains: the requests in flight finish whole, new ones get 503 with Retry-After meanwhile, then the
server stops (a real server on loopback)."""
from __future__ import annotations

import os
import signal

import httpx
import pytest

from bench.server_process import start_server, stop_server
from tests.reliability.helpers import MODEL, status, wait_for

IN_FLIGHT = {
    "model": MODEL,
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 200,
    "temperature": 0,
    "ignore_eos": True,
    "messages": [{"role": "user", "content": "Count slowly from one to a hundred."}],
}


@pytest.mark.slow
def test_sigterm_lets_requests_in_flight_finish_and_refuses_new_ones(tmp_path):
    server = start_server(tmp_path, "--drafter", "none", "--drain-timeout", "60")
    try:
        with httpx.stream("POST", server.api_url + "/chat/completions", json=IN_FLIGHT, timeout=120) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
            os.kill(server.process.pid, signal.SIGTERM)
            refused = wait_for(lambda: status(server.base_url, "/health/ready") == 503, 5)
            new = httpx.post(
                server.api_url + "/chat/completions",
                json={**IN_FLIGHT, "stream": False, "stream_options": None},
                timeout=30,
            )
            live = httpx.get(server.base_url + "/health/live", timeout=5).json()
            rest = "\n".join(lines)
        assert refused and new.status_code == 503, new.text
        assert new.json()["error"]["code"] == "shutting_down" and new.headers["retry-after"] == "1"
        assert live["engine"] == "draining"
        assert '"finish_reason":"length"' in rest and rest.rstrip().endswith("data: [DONE]") and '"error"' not in rest
        assert '"completion_tokens":200' in rest  # whole, not cut short
        server.process.wait(timeout=30)  # and then it stops
    finally:
        stop_server(server)
