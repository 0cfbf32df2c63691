"""Reading a request body: size limit (413), JSON (400) and pydantic validation (400)."""
from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import pydantic
from fastapi import Request

from server.errors import from_pydantic, invalid_json, request_too_large

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


async def read_request(request: Request, model: type[ModelT], max_request_bytes: int) -> ModelT:
    payload = parse_json(await read_body(request, max_request_bytes))
    try:
        return model.model_validate(payload)
    except pydantic.ValidationError as exc:
        raise from_pydantic(exc) from None


async def read_body(request: Request, max_request_bytes: int) -> bytes:
    """The raw body; 413 as soon as it (or its declared length) passes the limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_request_bytes:
        raise request_too_large(max_request_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_request_bytes:
            raise request_too_large(max_request_bytes)
    return bytes(body)


def parse_json(body: bytes) -> Any:
    """Strict JSON (RFC 8259): invalid UTF-8, lone surrogates and NaN are refused, not passed on to the tokenizer."""
    if not body:
        raise invalid_json("the body is empty")
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise invalid_json(str(exc)) from None
    except RecursionError:
        raise invalid_json("the JSON nests too deeply") from None
