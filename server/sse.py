"""Server-sent events: event encoding and a streaming response that always cleans up.

EventStreamResponse watches for the client's disconnect while it streams (also while
the stream waits on the engine), cancels the stream when the client goes away, and
then closes the body iterator and runs `on_close` shielded from further cancellation,
so that the engine request is aborted however the stream ends.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE_EVENT = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode_event(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(content, headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Plain asyncio tasks, not an anyio cancel scope: a task cancelled once lets the
        # engine stream's cleanup await its abort message, where a cancelled scope would
        # cancel that await too.
        stream = asyncio.ensure_future(self._stream_until_client_gone(send))
        listen = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listen):
                task.cancel()
            await asyncio.wait({stream, listen})
        if not stream.cancelled() and stream.exception() is not None:
            raise stream.exception()

    async def _stream_until_client_gone(self, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            pass  # the client went away mid-send

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                if self._on_close is not None:
                    await self._on_close()
