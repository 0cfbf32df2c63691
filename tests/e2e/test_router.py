"""The Shepherd Model Gateway (smg) in front of two real replicas (the session's default and plain servers), flagged as
docs/deployment.md deploys it: conversations through it stream, and every later turn comes back to the replica that
holds its session, named (X-Session-ID for the gateway, session_id for the replica) or not (placed by its text)."""
from __future__ import annotations

import httpx
import pytest

from bench.replicas import session_naming, start_router
from bench.server_process import stop_server
from scheduler.sessions import SESSION_KINDS
from tests.e2e.conftest import PLAIN_API_KEY


@pytest.fixture(scope="module")
def router(server, plain_server, tmp_path_factory):
    running, _ = start_router(tmp_path_factory.mktemp("router"), [server, plain_server], api_key=PLAIN_API_KEY)
    yield running
    stop_server(running)


def later_turns(*replicas) -> dict:
    """The replicas' later turns continued from their session cache and not, summed, by kind (/health)."""
    healths = [httpx.get(r.base_url + "/health", headers={"Authorization": f"Bearer {PLAIN_API_KEY}"},
                         timeout=10).json() for r in replicas]
    return {(outcome, kind): sum(h[f"session_{outcome}"][kind] for h in healths)
            for outcome in ("hits", "misses") for kind in SESSION_KINDS}


def test_every_later_turn_through_the_router_finds_its_session_named_or_not(router, server, plain_server):
    from openai import OpenAI

    client = OpenAI(base_url=router.api_url, api_key=PLAIN_API_KEY, max_retries=0, timeout=120)
    before = later_turns(server, plain_server)
    topics = ["the tides", "volcanoes", "honey bees", "glaciers"]
    for i, topic in enumerate(topics):
        headers, name = session_naming(f"router-e2e-{i}" if i % 2 == 0 else None)
        messages = [{"role": "system", "content": f"You answer questions about {topic} in plain words."},
                    {"role": "user", "content": f"Explain {topic} to a child in two sentences."}]
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                                temperature=0.0, stream=True, extra_headers=headers,
                                                extra_body=name)
        answer = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert answer
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Say it more simply."}]
        reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8,
                                               temperature=0.0, extra_headers=headers, extra_body=name)
        assert reply.usage.prompt_tokens_details.cached_tokens > 0, topic
    after = later_turns(server, plain_server)
    assert {key: after[key] - before[key] for key in after} == {
        ("hits", "explicit"): 2, ("hits", "implicit"): 2, ("misses", "explicit"): 0, ("misses", "implicit"): 0}
