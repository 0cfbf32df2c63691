"""Client disconnects: the SSE response and the non-streaming watch clean up after themselves."""
from __future__ import annotations

import asyncio

import pytest

from server import serving
from server.errors import ClientDisconnectedError
from server.sse import EventStreamResponse


class Closable:
    """An event stream that emits one event and then waits forever, recording its cleanup."""

    def __init__(self) -> None:
        self.log: list[str] = []

    async def events(self):
        try:
            yield "data: 1\n\n"
            await asyncio.Event().wait()
            yield "data: never\n\n"
        finally:
            await asyncio.sleep(0)  # cleanup that awaits, like sending an abort
            self.log.append("events closed")

    async def on_close(self) -> None:
        await asyncio.sleep(0)
        self.log.append("on_close")


def test_sse_response_cleans_up_when_the_client_disconnects_while_waiting():
    source, sent = Closable(), []

    async def receive():
        while not any(m.get("body") for m in sent):
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}  # the client leaves after the first event

    async def send(message):
        sent.append(message)

    response = EventStreamResponse(source.events(), on_close=source.on_close)
    asyncio.run(asyncio.wait_for(response({"type": "http"}, receive, send), timeout=5))
    assert source.log == ["events closed", "on_close"]
    assert sent[0]["type"] == "http.response.start"
    assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")


def test_sse_response_cleans_up_when_sending_fails():
    source = Closable()

    async def receive():
        await asyncio.Event().wait()

    async def send(message):
        if message["type"] == "http.response.body":
            raise OSError("connection reset")

    response = EventStreamResponse(source.events(), on_close=source.on_close)
    asyncio.run(asyncio.wait_for(response({"type": "http"}, receive, send), timeout=5))
    assert source.log == ["events closed", "on_close"]


class GoneRequest:
    async def is_disconnected(self) -> bool:
        return True


def test_watch_disconnect_cancels_the_work(monkeypatch):
    monkeypatch.setattr(serving, "DISCONNECT_POLL_S", 0.01)
    log = []

    async def work():
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # cleanup that awaits, like sending an abort
            log.append("work cancelled")

    with pytest.raises(ClientDisconnectedError):
        asyncio.run(serving.watch_disconnect(GoneRequest(), work()))
    assert log == ["work cancelled"]


def test_watch_disconnect_returns_the_result():
    async def work():
        return 42

    assert asyncio.run(serving.watch_disconnect(GoneRequest(), work())) == 42
