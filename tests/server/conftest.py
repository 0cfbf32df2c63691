"""Shared fixtures of the HTTP-layer unit tests: the embedded model's real tokenizer, and a client of the app
around an engine stand-in (`make_client`, used by test_http.py and test_auth.py)."""
from __future__ import annotations

from collections import Counter

import pytest
from fastapi.testclient import TestClient

from engine.config import ModelConfig
from engine.model.tokenizer import load_tokenizer
from engine.wire import EngineReady, StepStats
from server.app import build_app
from server.config import Config, ServerConfig


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2-135M-Instruct's tokenizer from the embedded GGUF (byte-level BPE, ChatML)."""
    return load_tokenizer(ModelConfig(model=None))


MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 64
READY = EngineReady(
    model_name=MODEL, max_model_len=MAX_MODEL_LEN, eos_token_ids=[2], latency_ms_by_num_tokens={}, vocab_size=49152,
)


class StandInEngine:
    """Readiness and health as given; `generate` records each request and fails at submission."""

    def __init__(self, ready: EngineReady | None = READY, healthy: bool = True, submit_error=None, gave_up=None):
        self.ready = ready
        self.healthy = healthy
        self.gave_up = gave_up
        self.live = gave_up is None
        self.num_restarts = 0 if healthy else 1
        self.last_exit_reason = None if healthy else "signal: the engine process was killed by SIGKILL"
        self.num_in_flight = 0
        self.submit_error = submit_error
        self.requests = []  # EngineRequests that reached generate
        self.events = []  # "start" / "shutdown"
        self.last_step_stats = StepStats(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_sessions=3)
        self.session_hits, self.session_misses = Counter(explicit=5), Counter(implicit=2)
        self.dead_reason = None if healthy else "killed by the test"
        self.metrics = None

    async def start(self):
        self.events.append("start")

    async def shutdown(self):
        self.events.append("shutdown")

    def generate(self, request):
        self.requests.append(request)
        return self._fail_at_submission()

    async def _fail_at_submission(self):
        raise self.submit_error or AssertionError("this test must not reach token generation")
        yield  # an async generator, like EngineClient.generate

    async def abort(self, request_id):
        pass


@pytest.fixture()
def make_client(tokenizer):
    def make(engine=None, **server_fields) -> tuple[TestClient, StandInEngine]:
        engine = engine or StandInEngine()
        app = build_app(Config(server=ServerConfig(**server_fields)), engine, tokenizer)
        return TestClient(app, raise_server_exceptions=False), engine

    return make
