"""Hostile and malformed input against a real server: every route fuzzed from the server's own OpenAPI document
(schemathesis: valid and invalid bodies, odd parameters), and a hand-written table of broken requests. No answer
may be a server error (status >= 500), and the server must be healthy afterwards.

The server runs with an 96-token context, so the valid requests the fuzzer finds generate at most a few dozen
tokens each and the run stays short.
"""
from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from bench.server_process import start_server, stop_server
from tests.reliability.helpers import MODEL

EXAMPLES_PER_ROUTE = 40


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("hostile"), "--max-model-len", "96", "--max-num-seqs", "4")
    yield server
    stop_server(server)


def openapi_document() -> dict:
    """The document the server serves at /openapi.json (built without an engine; a test below compares the two)."""
    from server.app import build_app
    from server.config import Config

    return build_app(Config(), engine=None, tokenizer=None).openapi()


schema = schemathesis.openapi.from_dict(openapi_document())


def test_the_fuzzed_document_is_the_one_the_server_serves(hostile_server):
    assert httpx.get(hostile_server.base_url + "/openapi.json").json() == openapi_document()


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_server_error(case, hostile_server):
    response = case.call(base_url=hostile_server.base_url, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


CHAT = "/v1/chat/completions"
JSON = {"content-type": "application/json"}
MALFORMED = [  # (name, path, raw body, headers)
    ("truncated JSON", CHAT, b'{"model": "x", "messages": [{"role": "user", "cont', JSON),
    ("invalid UTF-8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe\xfa"}]}', JSON),
    ("lone surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', JSON),
    ("NUL bytes", CHAT, b'{"messages": [{"role": "user", "content": "a\\u0000b"}], "max_tokens": 2}', JSON),
    ("form body", CHAT, b"messages=hello", {"content-type": "application/x-www-form-urlencoded"}),
    ("plain text", CHAT, b"hello", {"content-type": "text/plain"}),
    ("no content type", CHAT,
     json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode(), {}),
    ("empty body", CHAT, b"", JSON),
    ("JSON null", CHAT, b"null", JSON),
    ("JSON string", CHAT, b'"messages"', JSON),
    ("huge integer", CHAT,
     b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 400 + b"}", JSON),
    ("huge float", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', JSON),
    ("NaN", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', JSON),
    ("negative seed", CHAT,
     b'{"messages": [{"role": "user", "content": "hi"}], "seed": -99999999999999999999999}', JSON),
    ("deeply nested", CHAT, ('{"messages": ' + nested(100000) + "}").encode(), JSON),
    ("nested content", CHAT, ('{"messages": [{"role": "user", "content": ' + nested(5000) + "}]}").encode(), JSON),
    ("10 MB string", CHAT, b'{"messages": [{"role": "user", "content": "' + b"a" * 10_000_000 + b'"}]}', JSON),
    ("unknown role", CHAT, b'{"messages": [{"role": "wizard", "content": "hi"}]}', JSON),
    ("unknown content part", CHAT,
     b'{"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}', JSON),
    ("image part", CHAT,
     b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}', JSON),
    ("no messages", CHAT, b'{"messages": []}', JSON),
    ("messages not a list", CHAT, b'{"messages": {"role": "user"}}', JSON),
    ("stop of 1000 strings", CHAT,
     json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 1000}).encode(), JSON),
    ("duplicate keys", CHAT,
     b'{"max_tokens": 2, "max_tokens": -5, "messages": [{"role": "user", "content": "hi"}]}', JSON),
    ("prompt of huge token ids", "/v1/completions", b'{"prompt": [999999999, -1, 3]}', JSON),
    ("prompt of nested lists", "/v1/completions", b'{"prompt": [[[1]]]}', JSON),
    ("session id of 10 kB", CHAT,
     json.dumps({"messages": [{"role": "user", "content": "hi"}], "session_id": "s" * 10000}).encode(), JSON),
    ("model of 1 MB", CHAT,
     json.dumps({"model": "m" * 1_000_000, "messages": [{"role": "user", "content": "hi"}]}).encode(), JSON),
]


@pytest.mark.slow
def test_malformed_bodies_get_client_errors_and_the_server_stays_healthy(hostile_server):
    answers = {}
    with httpx.Client(base_url=hostile_server.base_url, timeout=60) as client:
        for name, path, body, headers in MALFORMED:
            response = client.post(path, content=body, headers=headers)
            answers[name] = response.status_code
            assert response.status_code < 500, (name, response.status_code, response.text[:300])
            if response.status_code >= 400:
                assert response.json()["error"]["message"], name
        assert client.get("/health").status_code == 200
        ok = client.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert ok.status_code == 200
    refused = {name for name, status in answers.items() if status >= 400}
    must_refuse = {"truncated JSON", "invalid UTF-8", "empty body", "deeply nested", "10 MB string", "unknown role"}
    assert refused >= must_refuse, answers
