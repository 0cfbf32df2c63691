"""Optional API key: `Authorization: Bearer <key>` on every /v1 route, compared in constant time."""
from __future__ import annotations

import hmac

from fastapi import Request

from server.errors import APIError


def invalid_api_key() -> APIError:
    return APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.", code="invalid_api_key")


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 unless the request carries the configured key (no key configured: open)."""
    expected = request.app.state.serving.config.server.api_key
    if expected is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise invalid_api_key()
