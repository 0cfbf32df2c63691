"""Status codes and OpenAI error bodies of the HTTP layer.

The engine stand-in covers only what these requests touch: readiness, health, and a
`generate` that fails at submission (queue full, engine dead) while recording what it
was sent. No test here generates tokens; those are the end-to-end tests.
"""
from __future__ import annotations

import json

import pytest

from engine.wire import EngineReady
from scheduler.admission import QueueFullError
from server.engine_client import EngineDeadError, EngineRequestError
from tests.server.conftest import MAX_MODEL_LEN, MODEL, StandInEngine

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def assert_error(response, status: int, param=None, code=None, type="invalid_request_error"):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert (error["type"], error["param"], error["code"]) == (type, param, code)
    return error


def test_invalid_json_is_400(make_client):
    client, _ = make_client()
    response = client.post(
        "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert_error(response, 400, code="invalid_json")
    assert_error(client.post("/v1/completions", content=b""), 400, code="invalid_json")
    for body in (
        b'{"prompt": "\\ud800"}',
        b'{"prompt": "\xff\xfe"}',
        b'{"prompt": "a", "top_p": NaN}',
        b"[" * 100000 + b"]" * 100000,
    ):
        assert_error(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400,
                     code="invalid_json")  # strict JSON: nothing the tokenizer or the sampler would choke on


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {**CHAT, "temperature": 5}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "n": 17}, "n"),  # above --max-choices (16)
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"49152": 5}}, "logit_bias"),  # outside the vocabulary
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"7": -101}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "if": {"type": "object"}}}}},
         "response_format"),  # not compilable
        ("/v1/completions", {**COMPLETION, "response_format": {"type": "regex", "regex": "[a-"}}, "response_format"),
        ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", [CHAT], None),
        ("/v1/completions", {**COMPLETION, "top_p": 0}, "top_p"),
        ("/v1/completions", {**COMPLETION, "stop": ["a"] * 5}, "stop"),
    ],
)
def test_validation_errors_are_400_naming_the_field(make_client, path, body, param):
    client, engine = make_client()
    assert_error(client.post(path, json=body), 400, param=param)
    assert engine.requests == []


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_unknown_model_is_404(make_client, path, body):
    client, _ = make_client()
    error = assert_error(client.post(path, json={**body, "model": "gpt-4o"}), 404, "model", "model_not_found")
    assert "gpt-4o" in error["message"]


def test_served_model_name_replaces_the_model_name(make_client):
    client, _ = make_client(served_model_name="alias")
    assert_error(client.post("/v1/completions", json=COMPLETION), 404, "model", "model_not_found")
    assert client.get("/v1/models").json()["data"][0]["id"] == "alias"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {**CHAT, "max_tokens": MAX_MODEL_LEN}, "messages"),
        ("/v1/completions", {**COMPLETION, "max_tokens": MAX_MODEL_LEN}, "prompt"),
        ("/v1/completions", {"prompt": [5] * MAX_MODEL_LEN}, "prompt"),  # no room left at all
    ],
)
def test_prompt_plus_max_tokens_over_the_context_is_400(make_client, path, body, param):
    client, engine = make_client()
    error = assert_error(client.post(path, json=body), 400, param, "context_length_exceeded")
    assert str(MAX_MODEL_LEN) in error["message"]
    assert engine.requests == []


def test_out_of_range_prompt_token_ids_are_400(make_client, tokenizer):
    client, _ = make_client()
    assert_error(client.post("/v1/completions", json={"prompt": [1, len(tokenizer)]}), 400, "prompt")


def test_body_over_the_limit_is_413(make_client):
    client, engine = make_client(max_request_bytes=1024)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
    assert_error(client.post("/v1/chat/completions", json=big), 413, code="request_too_large")
    chunks = iter([json.dumps(big).encode()[:600], json.dumps(big).encode()[600:]])
    assert_error(client.post("/v1/chat/completions", content=chunks), 413, code="request_too_large")
    assert engine.requests == []


def test_unknown_route_and_wrong_method_have_openai_bodies(make_client):
    client, _ = make_client()
    assert_error(client.post("/v1/embeddings", json={}), 404, code="not_found")
    response = client.get("/v1/chat/completions")
    assert_error(response, 405, code="method_not_allowed")
    assert "POST" in response.headers["allow"]


def test_health_and_models_when_ready(make_client):
    client, _ = make_client()
    expected = {
        "status": "ok", "num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "kv_cache_positions": 0,
        "num_sessions": 3,
        "drafter_state_bytes": 0, "session_host_bytes": 0, "engine_restarts": 0, "last_engine_exit": None,
        "session_hits": {"explicit": 5, "implicit": 0}, "session_misses": {"explicit": 0, "implicit": 2},
    }
    assert client.get("/health").json() == client.get("/health/ready").json() == expected
    assert client.get("/health/live").json() == {
        "status": "live",
        "engine": "ready",
        "engine_restarts": 0,
        "last_engine_exit": None,
    }
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"]) for m in models["data"]] == [(MODEL, "model")]


@pytest.mark.parametrize("engine", [StandInEngine(ready=None, healthy=False), StandInEngine(healthy=False)])
def test_not_ready_or_dead_engine_is_503(make_client, engine):
    client, _ = make_client(engine)
    assert_error(client.get("/health"), 503, code="engine_unavailable", type="server_error")
    assert_error(client.get("/health/ready"), 503, code="engine_unavailable", type="server_error")
    assert client.get("/health/live").json()["engine"] == "starting"  # live: the supervisor starts an engine
    assert_error(client.get("/v1/models"), 503, code="engine_unavailable", type="server_error")
    for path, body in [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]:
        response = client.post(path, json=body)
        assert_error(response, 503, code="engine_unavailable", type="server_error")
        assert response.headers["retry-after"] == "5"
    assert engine.requests == []


def test_a_server_that_gave_up_restarting_its_engine_is_not_live(make_client):
    client, _ = make_client(StandInEngine(healthy=False, gave_up="the engine died too often"))
    error = assert_error(client.get("/health/live"), 503, code="gave_up", type="server_error")
    assert "died too often" in error["message"]
    assert "retry-after" not in client.post("/v1/completions", json=COMPLETION).headers


def test_a_draining_server_refuses_new_requests_with_retry_after(make_client):
    client, engine = make_client()
    client.app.state.serving.draining = True
    for path, body in [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]:
        response = client.post(path, json=body)
        assert_error(response, 503, code="shutting_down", type="server_error")
        assert response.headers["retry-after"] == "1"
    assert_error(client.get("/health/ready"), 503, code="shutting_down", type="server_error")
    assert client.get("/health/live").json()["engine"] == "draining"
    assert engine.requests == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "submit_error, status, code, type",
    [
        (QueueFullError("8 requests waiting"), 429, "queue_full", "rate_limit_error"),
        (EngineDeadError("engine process exited"), 503, "engine_unavailable", "server_error"),
        (EngineRequestError("the prompt is empty"), 400, None, "invalid_request_error"),
    ],
)
def test_submission_failures_keep_their_status_when_streaming(make_client, stream, submit_error, status, code, type):
    client, _ = make_client(StandInEngine(submit_error=submit_error))
    assert_error(client.post("/v1/chat/completions", json={**CHAT, "stream": stream}), status, code=code, type=type)


def test_engine_request_carries_sampling_and_session(make_client, tokenizer):
    client, engine = make_client(StandInEngine(submit_error=QueueFullError()))
    body = {**CHAT, "temperature": 0, "top_k": -1, "seed": 7, "stop": "x", "max_tokens": None}
    client.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "from-header"})
    client.post("/v1/completions", json={**COMPLETION, "session_id": "from-body"}, headers={"X-Session-ID": "h"})
    chat_request, completion_request = engine.requests
    assert chat_request.request_id.startswith("chatcmpl-") and completion_request.request_id.startswith("cmpl-")
    assert chat_request.prompt_token_ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    sampling = chat_request.sampling
    # the engine owns EOS
    assert sampling.greedy and (sampling.top_k, sampling.seed, sampling.stop_token_ids) == (0, 7, [])
    assert sampling.max_tokens == MAX_MODEL_LEN - len(chat_request.prompt_token_ids)
    assert (chat_request.session_id, completion_request.session_id) == ("from-header", "from-body")
    assert completion_request.sampling.max_tokens == 4
    assert not chat_request.continues and not completion_request.continues  # first turns; a completion cannot say


def test_a_chat_request_holding_an_earlier_reply_is_sent_as_a_later_turn(make_client):
    client, engine = make_client(StandInEngine(submit_error=QueueFullError()))
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "and?"}]
    client.post("/v1/chat/completions", json={**CHAT, "messages": turns})
    client.post("/v1/chat/completions", json={**CHAT, "messages": turns[:1]})
    assert [request.continues for request in engine.requests] == [True, False]


def test_lifespan_starts_and_shuts_down_the_engine(make_client):
    client, engine = make_client()
    with client:
        assert engine.events == ["start"]
    assert engine.events == ["start", "shutdown"]


TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "tools, tool_choice, param",
    [
        ([TIME_TOOL], {"type": "function", "function": {"name": "get_date"}}, "tool_choice"),  # not offered
        (None, "required", "tool_choice"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}], "required", "tools"),
    ],
)
def test_tool_calls_that_cannot_be_forced_are_400(make_client, tools, tool_choice, param):
    client, engine = make_client()
    assert_error(
        client.post("/v1/chat/completions", json={**CHAT, "tools": tools, "tool_choice": tool_choice}), 400, param
    )
    assert engine.requests == []


def test_tools_reach_the_prompt_and_a_forced_call_its_grammar(make_client, tokenizer):
    roomy = EngineReady(
        model_name=MODEL, max_model_len=4096, eos_token_ids=[2], latency_ms_by_num_tokens={}, vocab_size=49152
    )
    client, engine = make_client(StandInEngine(ready=roomy, submit_error=QueueFullError()))
    for tool_choice in ("required", "auto", "none"):
        client.post("/v1/chat/completions", json={**CHAT, "tools": [TIME_TOOL], "tool_choice": tool_choice})
    required, auto, none = engine.requests
    assert "get_time" in required.sampling.grammar and auto.sampling.grammar is None and none.sampling.grammar is None
    assert (
        "<tools>" in tokenizer.decode(required.prompt_token_ids) and required.prompt_token_ids == auto.prompt_token_ids
    )
    assert "<tools>" not in tokenizer.decode(none.prompt_token_ids)
