"""A real server started with an API key (tests/e2e/conftest.py's plain one): the openai client needs it."""
import httpx
import openai
import pytest

from tests.e2e.conftest import PLAIN_API_KEY as KEY


def test_the_key_is_required_and_sufficient(plain_server):
    without = openai.OpenAI(base_url=plain_server.api_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        without.models.list()
    response = httpx.post(
        plain_server.api_url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with_key = openai.OpenAI(base_url=plain_server.api_url, api_key=KEY, max_retries=0)
    reply = with_key.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert reply.choices[0].message.content
    assert httpx.get(plain_server.base_url + "/health").status_code == 200
