"""The optional API key guards the OpenAI routes; health stays open for probes."""
import pytest

from server.config import ServerConfig
from tests.server.test_http import CHAT, assert_error

KEY = "sk-test-123"


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}],
)
def test_requests_without_the_key_get_401(make_client, headers):
    client, engine = make_client(api_key=KEY)
    for response in (
        client.get("/v1/models", headers=headers),
        client.post("/v1/chat/completions", json=CHAT, headers=headers),
    ):
        assert_error(response, 401, code="invalid_api_key")
    assert engine.requests == []


def test_requests_with_the_key_pass_and_health_needs_none(make_client):
    client, _ = make_client(api_key=KEY)
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    assert client.get("/health").status_code == 200


def test_no_key_configured_means_open(make_client):
    client, _ = make_client()
    assert client.get("/v1/models").status_code == 200


def test_an_empty_key_is_refused_at_start_up():
    with pytest.raises(ValueError, match="empty API key"):
        ServerConfig(api_key="")
