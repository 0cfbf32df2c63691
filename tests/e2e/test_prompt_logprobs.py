"""Prompt log-probabilities through the official openai client: `echo` with `logprobs` (and `max_tokens` 0), as
lm-evaluation-harness scores multiple-choice tasks, and vLLM's `prompt_logprobs` extension; against the default server
(CopySpec) and the plain one, which must agree."""
import openai
import pytest

from tests.e2e.conftest import PLAIN_API_KEY

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Question: What is the capital of France?\nAnswer: The capital of France is Paris."


@pytest.fixture(scope="module")
def plain_client(plain_server):
    from openai import OpenAI

    return OpenAI(base_url=plain_server.api_url, api_key=PLAIN_API_KEY, max_retries=0, timeout=120)


def scored(client, prompt=PROMPT, **kwargs):
    kwargs.setdefault("max_tokens", 1)
    return client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, temperature=0.0, **kwargs)


def test_an_echoed_prompt_comes_back_with_each_tokens_logprob(client, plain_client):
    reply = scored(client)
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert "".join(logprobs.tokens) == choice.text
    assert len(logprobs.tokens) == reply.usage.prompt_tokens + 1 == len(logprobs.token_logprobs)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp < 0 for lp in logprobs.token_logprobs[1:])
    assert all(len(top) == 1 and max(top.values()) >= lp - 1e-5
               for top, lp in zip(logprobs.top_logprobs[1:], logprobs.token_logprobs[1:]))
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    assert scored(plain_client).choices[0].logprobs.token_logprobs == pytest.approx(logprobs.token_logprobs, abs=1e-4)


def test_max_tokens_0_scores_the_prompt_alone(client):
    reply = scored(client, max_tokens=0)
    choice = reply.choices[0]
    assert choice.text == PROMPT and "".join(choice.logprobs.tokens) == PROMPT
    assert len(choice.logprobs.token_logprobs) == reply.usage.prompt_tokens
    assert reply.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == scored(client).choices[0].logprobs.token_logprobs[:-1]


def test_the_figures_do_not_depend_on_what_the_session_cache_holds(client):
    """The prompt's first part is cached by a session's turn, then the whole prompt is scored in that session: the
    figures equal those of a request no cache served."""
    cold = scored(client, max_tokens=0, extra_body={"session_id": "echo-cold"}).choices[0].logprobs.token_logprobs
    client.completions.create(model=MODEL, prompt=PROMPT[:40], max_tokens=4, temperature=0.0,
                              extra_body={"session_id": "echo-warm"})
    warm = scored(client, max_tokens=0, extra_body={"session_id": "echo-warm"})
    assert warm.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].logprobs.token_logprobs == cold


def test_prompt_logprobs_extension_on_both_endpoints(client):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0.0,
                                      extra_body={"prompt_logprobs": 2})
    entries = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == reply.usage.prompt_tokens and entries[0] is None
    echoed = scored(client).choices[0].logprobs.token_logprobs
    for entry, logprob in zip(entries[1:], echoed[1:]):
        assert 2 <= len(entry) <= 3 and {1, 2} <= {e["rank"] for e in entry.values()}
        assert logprob in [pytest.approx(e["logprob"], abs=1e-6) for e in entry.values()]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0.0, extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == chat.usage.prompt_tokens and entries[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] >= 1 for entry in entries[1:])


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0, "echo": False}, "max_tokens"),
    ({"echo": True, "stream": True}, "echo"),
    ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
])
def test_prompt_scoring_it_cannot_do_is_a_400_naming_the_parameter(client, fields, param):
    fields.setdefault("max_tokens", 4)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, **fields)
    assert info.value.body["param"] == param
