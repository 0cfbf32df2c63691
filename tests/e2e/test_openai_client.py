"""The official openai client against a real specserve on loopback (embedded default model)."""
import concurrent.futures

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


def chat(client, messages=QUESTION, **kwargs):
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 40)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def test_models_lists_the_default_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_non_streamed_chat_is_coherent_and_carries_usage_and_spec_stats(client):
    reply = chat(client)
    text = reply.choices[0].message.content
    assert reply.choices[0].message.role == "assistant"
    assert any(colour in text.lower() for colour in ("red", "orange", "yellow", "green", "blue", "violet"))
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 10 and 0 < reply.usage.completion_tokens <= 40
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    stats = reply.model_extra["spec_stats"]
    assert stats["mean_acceptance_length"] >= 1.0 and stats["accepted_tokens"] <= stats["drafted_tokens"]


def test_streamed_chat_equals_non_streamed_chat(client):
    expected = chat(client).choices[0].message.content
    stream = chat(client, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_stop_string_cuts_the_text_before_it(client):
    full = chat(client, max_tokens=30).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 4]
    reply = chat(client, max_tokens=30, stop=[stop])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == full[:full.index(stop)]


def test_seeded_sampling_is_reproducible(client):
    first = chat(client, temperature=0.9, top_p=0.95, seed=7, max_tokens=20).choices[0].message.content
    second = chat(client, temperature=0.9, top_p=0.95, seed=7, max_tokens=20).choices[0].message.content
    assert first == second


def test_text_completion_with_text_and_token_prompts(client):
    by_text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert by_text.choices[0].text and by_text.usage.completion_tokens <= 8
    by_ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=4, temperature=0)
    assert by_ids.usage.prompt_tokens == 5


def test_concurrent_requests_all_finish_and_equal_their_solo_answers(client):
    questions = [[{"role": "user", "content": f"Write a sentence about the number {n}."}] for n in range(6)]
    solo = [chat(client, messages=q, max_tokens=24).choices[0].message.content for q in questions]
    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        together = list(
            pool.map(lambda q: chat(client, messages=q, max_tokens=24).choices[0].message.content, questions)
        )
    assert together == solo


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": MODEL, "messages": QUESTION, "temperature": 5}, 400, "temperature"),
        ({"model": MODEL, "messages": QUESTION, "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": QUESTION, "n": 17}, 400, "n"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL}, 400, "messages"),
        ({"model": "no-such-model", "messages": QUESTION}, 404, "model"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 9000}]}, 400, "messages"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param):
    response = httpx.post(server.api_url + "/chat/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_invalid_json_and_unknown_route(server):
    response = httpx.post(
        server.api_url + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.api_url + "/nothing-here").status_code == 404


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=QUESTION)
    with pytest.raises(openai.BadRequestError):
        chat(client, temperature=-1)
    assert chat(client, max_tokens=3).choices[0].message.content  # and the server still serves


def test_ignore_eos_generates_exactly_max_tokens(client):
    """The answer stops by itself; with ignore_eos the same request runs past its end to exactly max_tokens."""
    question = [{"role": "user", "content": "What is 2 + 2?"}]  # answered in a dozen tokens
    short = chat(client, messages=question, max_tokens=200)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 200
    limit = short.usage.completion_tokens + 10
    longer = chat(client, messages=question, max_tokens=limit, extra_body={"ignore_eos": True})
    assert longer.choices[0].finish_reason == "length" and longer.usage.completion_tokens == limit


def test_metrics_count_what_the_server_did(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    chat(
        client,
        messages=[{"role": "user", "content": "Repeat exactly: one two three four. one two three four."}],
        max_tokens=30,
    )
    families = text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text)
    values = {
        (s.name, s.labels.get("drafter")): s.value
        for f in families
        for s in f.samples
        if s.labels.get("model_name") == MODEL
    }
    assert values[("specserve:engine_healthy", None)] == 1
    assert values[("specserve:generation_tokens_total", None)] > 0
    assert values[("specserve:time_to_first_token_seconds_count", None)] > 0
    assert values[("specserve:spec_decode_num_draft_tokens_total", "copyspec")] > 0
