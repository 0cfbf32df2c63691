"""OpenAI-style error bodies and the FastAPI exception handlers that produce them.

Every error leaves the server as {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.admission import QueueFullError
from server.engine_client import EngineDeadError, EngineRequestError

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class ClientDisconnectedError(Exception):
    """The HTTP client went away before its response was ready."""


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def engine_unavailable(message: str = "the engine is not ready", retry_after_s: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else None
    return APIError(503, message, SERVER_ERROR, code="engine_unavailable", headers=headers)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica", SERVER_ERROR, code="shutting_down",
                    headers={"Retry-After": "1"})


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def request_too_large(max_request_bytes: int) -> APIError:
    message = f"request body is larger than {max_request_bytes} bytes"
    return APIError(413, message, code="request_too_large")


def invalid_json(detail: str) -> APIError:
    return APIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")


def context_length_exceeded(
    max_model_len: int, num_prompt_tokens: int, max_tokens: int | None, param: str
) -> APIError:
    if max_tokens is None:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{param} resulted in {num_prompt_tokens} tokens, leaving no room for a completion. "
            f"Please reduce the length of the {param}."
        )
    else:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {param}, "
            f"{max_tokens} in the completion). Please reduce the length of the {param} or completion."
        )
    return APIError(400, message, param=param, code="context_length_exceeded")


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """The first pydantic error as a 400 naming the offending field (e.g. "messages[0].role")."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return invalid_json(first.get("msg", ""))
    param = param_of_location(first.get("loc", ()))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def from_pydantic(exc: pydantic.ValidationError) -> APIError:
    return from_validation_errors(exc.errors(include_url=False))


def param_of_location(loc: tuple | list) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"; drops union-branch tags."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part != "body" and not _is_union_tag(part):
            param += f".{part}" if param else part
    return param or None


def _is_union_tag(part: str) -> bool:
    return any(c in part for c in "[]()-") or part in {"str", "int", "float", "bool", "list", "dict"}


# ---- handlers ----------------------------------------------------------------


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_request_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(EngineDeadError, _on_engine_error)
    app.add_exception_handler(QueueFullError, _on_engine_error)
    app.add_exception_handler(EngineRequestError, _on_engine_error)
    app.add_exception_handler(ClientDisconnectedError, _on_client_disconnected)


def api_error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=headers or error.headers)


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return api_error_response(exc)


async def _on_request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    return api_error_response(from_validation_errors(list(exc.errors())))


async def _on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    route = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        error = APIError(404, f"Unknown route: {route}", code="not_found")
    elif exc.status_code == 405:
        error = APIError(405, f"Method not allowed: {route}", code="method_not_allowed")
    else:
        error = APIError(exc.status_code, str(exc.detail), _type_of_status(exc.status_code))
    return api_error_response(error, headers=getattr(exc, "headers", None))


def _type_of_status(status_code: int) -> str:
    return SERVER_ERROR if status_code >= 500 else INVALID_REQUEST


async def _on_engine_error(request: Request, exc: Exception) -> JSONResponse:
    return api_error_response(error_of_exception(exc))


async def _on_client_disconnected(request: Request, exc: ClientDisconnectedError) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def error_of_exception(exc: BaseException) -> APIError:
    """The APIError an exception raised mid-generation stands for (for SSE error events)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(f"the engine is not available: {exc}")
    if isinstance(exc, QueueFullError):
        message = f"the server is at capacity, retry later ({exc})" if str(exc) else "the server is at capacity"
        return APIError(429, message, "rate_limit_error", code="queue_full")
    if isinstance(exc, EngineRequestError):
        return APIError(400, f"the engine refused the request: {exc}")
    return APIError(500, f"internal error: {exc}", SERVER_ERROR)
