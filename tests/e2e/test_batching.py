"""Continuous batching through HTTP: KV blocks come back, and a flood beyond the queue bound gets 429s."""
import concurrent.futures
import threading

import httpx
import pytest

from bench.server_process import start_server, stop_server
from tests.e2e.test_lifecycle import wait_for

MODEL = "SmolLM2-135M-Instruct"


def chat_body(content: str, max_tokens: int, stream: bool) -> dict:
    return {
        "model": MODEL, "stream": stream, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": content}],
    }


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """Two seats, two waiting places and a small KV pool."""
    running = start_server(
        tmp_path_factory.mktemp("batching"), "--max-num-seqs", "2", "--max-waiting", "2", "--kv-cache-memory", "0.1"
    )
    yield running
    stop_server(running)


def health(server) -> dict:
    return httpx.get(server.base_url + "/health", timeout=5).json()


def kv_usage_metric(server) -> float:
    for line in httpx.get(server.base_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("specserve:kv_cache_usage_perc{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("specserve:kv_cache_usage_perc is missing from /metrics")


class Stream:
    """A streamed chat request held open on its own thread until `release` is set, then dropped."""

    def __init__(self, server, content: str, max_tokens: int) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(server, content, max_tokens))
        self.thread.start()

    def _run(self, server, content: str, max_tokens: int) -> None:
        body = chat_body(content, max_tokens, stream=True)
        with httpx.stream("POST", server.api_url + "/chat/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
            self.started.set()
            self.release.wait(timeout=120)  # then the client goes away mid-stream

    def drop(self) -> None:
        self.release.set()
        self.thread.join(timeout=30)


def test_a_flood_beyond_the_queue_bound_gets_429s_while_admitted_requests_complete(small_server):
    holders = [Stream(small_server, f"Count from one to a thousand, {n}.", max_tokens=2000) for n in range(2)]
    try:
        assert all(h.started.wait(timeout=120) for h in holders), "the two long streams never started"

        def ask(n):
            return httpx.post(
                small_server.api_url + "/chat/completions",
                json=chat_body(f"Name a colour, {n}.", 4, False),
                timeout=120,
            )

        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            futures = [pool.submit(ask, n) for n in range(10)]
            assert wait_for(lambda: sum(f.done() for f in futures) >= 8, deadline_s=60), "refusals must not wait"
            for holder in holders:  # seats free up: the two queued requests run
                holder.drop()
            responses = [f.result() for f in futures]
    finally:
        for holder in holders:
            holder.drop()
    refused = [r for r in responses if r.status_code == 429]
    served = [r for r in responses if r.status_code == 200]
    assert len(refused) == 8 and len(served) == 2, [r.status_code for r in responses]
    for response in refused:
        error = response.json()["error"]
        assert error["type"] == "rate_limit_error" and "waiting" in error["message"]
    for response in served:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"]


def test_kv_blocks_return_to_zero_after_finished_and_disconnected_clients(small_server):
    dropped = Stream(small_server, "Tell me a long story about a ship.", max_tokens=2000)  # takes one of the two seats
    try:
        assert dropped.started.wait(timeout=120)
        assert health(small_server)["kv_cache_usage"] > 0
        finished = httpx.post(
            small_server.api_url + "/chat/completions", json=chat_body("Say hi.", 8, False), timeout=120
        )
        assert finished.status_code == 200
    finally:
        dropped.drop()
    assert wait_for(
        lambda: health(small_server)["kv_cache_usage"] == 0 and health(small_server)["num_running"] == 0, 30
    )
    assert kv_usage_metric(small_server) == 0
