"""Stored responses of the Responses API (`store`, the default): what `previous_response_id` continues and
GET /v1/responses/{id} returns, bounded in bytes, the oldest evicted first."""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    messages: list[dict[str, Any]]  # the conversation through this response's output, in chat form, no system message
    session_id: str | None  # the session cache entry the conversation's KV and drafter state live under

    @property
    def num_bytes(self) -> int:
        return len(json.dumps(self.response)) + len(json.dumps(self.messages))


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._responses: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self.num_bytes = 0

    def put(self, response_id: str, stored: StoredResponse) -> None:
        size = stored.num_bytes
        if size > self.max_bytes:
            return  # larger than the whole store: kept nowhere, as if evicted at once
        self._responses[response_id] = (stored, size)
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, (_, evicted) = self._responses.popitem(last=False)
            self.num_bytes -= evicted

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._responses.get(response_id)
        return entry[0] if entry is not None else None

    def __len__(self) -> int:
        return len(self._responses)
