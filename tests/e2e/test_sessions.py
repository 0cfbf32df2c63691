"""Session caches through HTTP with the official openai client: found implicitly and by name, edits, tight memory."""
import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from bench.exactness import divergence_verdict
from bench.mt import render_prompt
from bench.server_process import start_server, stop_server
from engine.config import ModelConfig
from engine.model.model_loader import load_model
from engine.model.tokenizer import load_tokenizer

MODEL = "SmolLM2-135M-Instruct"
TURN1 = "Write a short poem about a lighthouse keeper."
TURN2 = "Now rewrite the poem in the past tense."


def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def off_client(tmp_path_factory):
    """A server without session caches: what every answer must equal."""
    running = start_server(
        tmp_path_factory.mktemp("sessions-off"), "--session-mode", "off", "--kv-cache-memory", "0.25"
    )
    yield openai_client(running)
    stop_server(running)


@pytest.fixture(scope="module")
def reference_model():
    model_config = ModelConfig()
    return load_model(model_config).model, load_tokenizer(model_config)


def chat(client, messages, max_tokens=48, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0.0, max_tokens=max_tokens, **kwargs
    )


def assert_same_answer(reference_model, messages, expected: str, actual: str) -> None:
    """Equal texts, or a divergence at a genuine near-tie of the reference (docs/architecture.md's rule, on
    re-tokenized texts)."""
    if expected == actual:
        return
    model, tokenizer = reference_model
    prompt = render_prompt(tokenizer, messages)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    with torch.inference_mode():
        verdict = divergence_verdict(model, prompt, encode(expected), encode(actual))
    assert verdict != "mismatch", (expected, actual)


def metric(server, name: str) -> float:
    families = text_string_to_metric_families(httpx.get(server.base_url + "/metrics", timeout=10).text)
    return sum(s.value for f in families for s in f.samples if s.name == name and s.labels.get("model_name") == MODEL)


def conversations(server) -> dict:
    """/health's later turns since the server started: continued from a cached session or not, by kind."""
    health = httpx.get(server.base_url + "/health", timeout=10).json()
    return {"hits": health["session_hits"], "misses": health["session_misses"]}


def test_an_unmodified_client_resending_the_history_finds_its_session(server, client, off_client, reference_model):
    hits_before = metric(server, "specserve:session_cache_hits_total")
    counted_before = conversations(server)
    first = [{"role": "user", "content": TURN1}]
    answer = chat(client, first).choices[0].message.content
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": TURN2}]
    reply = chat(client, second)
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert cached >= reply.usage.prompt_tokens - 40, "the whole history before the new turn should be reused"
    assert metric(server, "specserve:session_cache_hits_total") > hits_before
    assert metric(server, "specserve:session_cache_reused_prefix_tokens_total") >= cached
    counted = conversations(server)
    assert counted["hits"]["implicit"] == counted_before["hits"]["implicit"] + 1  # the second turn; the first: neither
    assert counted["misses"] == counted_before["misses"]
    assert_same_answer(
        reference_model, second, chat(off_client, second).choices[0].message.content, reply.choices[0].message.content
    )


def test_a_named_session_is_found_by_header_and_by_body_field(server, client):
    counted_before = conversations(server)
    first = [{"role": "user", "content": "List four animals that live in the sea."}]
    answer = chat(client, first, extra_headers={"X-Session-ID": "e2e-named"}).choices[0].message.content
    second = first + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Now list them in reverse."},
    ]
    by_header = chat(client, second, extra_headers={"X-Session-ID": "e2e-named"})
    assert by_header.usage.prompt_tokens_details.cached_tokens > 0
    by_body = chat(client, second, extra_body={"session_id": "e2e-named"})
    assert by_body.usage.prompt_tokens_details.cached_tokens > 0
    assert by_body.choices[0].message.content == by_header.choices[0].message.content
    chat(client, second, max_tokens=1, extra_headers={"X-Session-ID": "e2e-held-elsewhere"})  # arrives without it
    counted = conversations(server)
    assert counted["hits"]["explicit"] == counted_before["hits"]["explicit"] + 2
    assert counted["misses"]["explicit"] == counted_before["misses"]["explicit"] + 1


def test_a_client_that_edits_an_earlier_turn_gets_the_answer_a_fresh_server_gives(client, off_client, reference_model):
    first = [{"role": "user", "content": "Describe a red bicycle in two sentences."}]
    answer = chat(client, first).choices[0].message.content
    chat(client, first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Make it shorter."}])
    edited = [{"role": "user", "content": "Describe a blue bicycle in two sentences."}]  # turn 1 edited, resent
    reply = chat(client, edited)
    assert 0 < reply.usage.prompt_tokens_details.cached_tokens < reply.usage.prompt_tokens  # the part before the edit
    assert_same_answer(
        reference_model, edited, chat(off_client, edited).choices[0].message.content, reply.choices[0].message.content
    )


def test_an_overlong_session_id_is_a_400(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    by_header = httpx.post(
        server.api_url + "/chat/completions", json=body, headers={"X-Session-ID": "x" * 300}, timeout=60
    )
    assert by_header.status_code == 400 and by_header.json()["error"]["param"] == "X-Session-ID"
    by_body = httpx.post(server.api_url + "/chat/completions", json={**body, "session_id": "x" * 300}, timeout=60)
    assert by_body.status_code == 400 and by_body.json()["error"]["param"] == "session_id"


def test_under_a_tight_memory_budget_sessions_are_evicted_and_requests_keep_succeeding(tmp_path):
    """About 460 KV positions: six two-turn conversations of about 200 positions each cannot all stay cached."""
    tight = start_server(tmp_path, "--kv-cache-memory", "0.02", "--max-num-seqs", "2")
    try:
        client = openai_client(tight)
        for n in range(6):
            first = [{"role": "user", "content": f"Tell me a fact about the number {n + 3} and why it matters."}]
            answer = chat(client, first, max_tokens=64, extra_body={"ignore_eos": True})
            assert answer.choices[0].finish_reason == "length"
            second = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                              {"role": "user", "content": "Say that again in other words."}]
            assert (
                chat(client, second, max_tokens=64, extra_body={"ignore_eos": True}).choices[0].finish_reason
                == "length"
            )
        assert metric(tight, "specserve:session_cache_evictions_total") > 0
        assert metric(tight, "specserve:session_cache_hits_total") > 0
        assert metric(tight, "specserve:num_preemptions_total") == 0
        assert httpx.get(tight.base_url + "/health", timeout=5).json()["kv_cache_usage"] == 0
    finally:
        stop_server(tight)
