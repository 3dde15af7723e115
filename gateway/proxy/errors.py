"""OpenAI-shaped errors: one exception type, one renderer, one set of handlers.

Every error leaves kvgate as ``{"error": {"message", "type", "param", "code"}}``
with ``code`` equal to the HTTP status (as vLLM does), never as a bare 500. On the
Anthropic Messages routes kvgate's own errors take Anthropic's shape instead,
``{"type": "error", "error": {"type", "message"}}`` (its SDK parses them).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.core.errors import KvgateError

log = logging.getLogger("kvgate.proxy")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error answered to the client."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or _TYPES.get(status, "server_error")
        self.headers = headers or {}


def error_body(
    status: int, message: str, *, param: str | None = None, error_type: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type or _TYPES.get(status, "server_error"),
            "param": param,
            "code": status,
        }
    }


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape for ``status``."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(exc: ApiError, shape: str = "openai") -> JSONResponse:
    """The error as JSON: OpenAI's shape, or Anthropic's with ``shape="anthropic"``."""
    body = (
        anthropic_error_body(exc.status, exc.message)
        if shape == "anthropic"
        else error_body(exc.status, exc.message, param=exc.param, error_type=exc.error_type)
    )
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def install_handlers(app: FastAPI) -> None:
    """Map every exception to an OpenAI-shaped JSON error."""

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(KvgateError)
    async def _kvgate(_: Request, exc: KvgateError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status_code == 503 else None
        return error_response(
            ApiError(exc.status_code, exc.message, param=exc.param, headers=headers)
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(
            ApiError(400, f"{loc or 'request'}: {first.get('msg', 'invalid')}", param=loc or None)
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = "not found"
        elif exc.status_code == 405:
            message = "method not allowed"
        return error_response(ApiError(exc.status_code, message, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error: %s", type(exc).__name__)
        return error_response(ApiError(500, "internal error in kvgate", error_type="server_error"))
