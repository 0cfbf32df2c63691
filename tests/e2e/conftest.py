"""Real specserve processes on loopback, started the way `make serve` starts them: the default one, and one that
decodes plainly behind an API key (the reference speculation is compared with, and the key's checks)."""
from __future__ import annotations

import pytest

from bench.server_process import start_server, stop_server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    running = start_server(tmp_path_factory.mktemp("server"), "--max-num-seqs", "4")
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


PLAIN_API_KEY = "sk-e2e-secret"


@pytest.fixture(scope="session")
def plain_server(tmp_path_factory):
    running = start_server(tmp_path_factory.mktemp("plain-server"), "--drafter", "none", "--max-num-seqs", "4",
                           "--api-key", PLAIN_API_KEY)
    yield running
    stop_server(running)
