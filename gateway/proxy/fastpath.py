"""A pure ASGI fast path for every proxied endpoint.

It answers the proxied endpoints (:mod:`gateway.proxy.endpoints`: completions, chat,
Responses, Messages, embeddings and the other pooling routes, tokenize, audio, stored
responses) itself, with the handler FastAPI's documented routes use, but without
Starlette's request object, routing, dependency resolution and exception layers in
between (a third of the gateway's own CPU time per request). Every other request goes on to the
FastAPI app. Responses are Starlette ``Response`` objects, so streaming and
client-disconnect handling are Starlette's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Coroutine
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.proxy.deps import GatewayState
from gateway.proxy.endpoints import match
from gateway.proxy.errors import ApiError, error_response
from gateway.proxy.intake import handle_request
from gateway.proxy.ratelimit import client_ip

log = logging.getLogger("kvgate.proxy")


class ClientGoneError(Exception):
    """The client disconnected before its request body arrived."""


def client_credentials(headers: dict[str, str]) -> str | None:
    """The client's key as an Authorization value: its ``Authorization`` header, else an
    ``x-api-key`` (what the Anthropic SDK sends) as a Bearer token."""
    authorization = headers.get("authorization")
    if authorization:
        return authorization
    api_key = headers.get("x-api-key")
    return f"Bearer {api_key}" if api_key else None


def check_client_key(state: GatewayState, authorization: str | None) -> int | None:
    """The position in ``api_keys`` of the client's Bearer key (None when no keys are set),
    or a 401. Constant-time: every key is compared, whichever matched."""
    keys = state.settings.api_keys
    if not keys:
        return None
    scheme, _, token = (authorization or "").partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    matched = -1
    for i, key in enumerate(keys):  # compare with every key: timing does not tell which matched
        if bool(given) and hmac.compare_digest(key.get_secret_value().encode(), given):
            matched = i
    if matched < 0:
        raise ApiError(
            401,
            "missing or invalid API key (send it as 'Authorization: Bearer ...')",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return matched


def admit(state: GatewayState, route: str, authorization: str | None, client: Any) -> None:
    """Client authentication and rate limit of one ``/v1`` request (401 or 429).

    A per-IP limit comes first (it also slows down key guessing); a per-key one needs the
    key, so it comes after authentication."""
    limiter = state.limiter
    if limiter is None:
        check_client_key(state, authorization)
    elif limiter.by_key:
        limiter.check(f"key:{check_client_key(state, authorization)}", route)
    else:
        limiter.check(client_ip(client), route)
        check_client_key(state, authorization)


async def read_asgi_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError(400, "invalid Content-Length header") from None
        if size > limit:
            raise ApiError(413, f"request body is larger than {limit} bytes")
    parts: list[bytes] = []
    total = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGoneError
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise ApiError(413, f"request body is larger than {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _unless_client_leaves(work: Coroutine[Any, Any, Response], receive: Receive) -> Response:
    """Run ``work`` but cancel it if the client disconnects first (a held request must not
    keep its place in the router queue for nobody)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(receive())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            message = watch.result()
            if message["type"] == "http.disconnect":
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ClientGoneError
            return await task
        return task.result()
    finally:
        if not watch.done():
            watch.cancel()


class OpenAIFastPath:
    """ASGI middleware: serves the proxied routes directly, passes the rest on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = match(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if found is None:
            await self.app(scope, receive, send)
            return
        endpoint, response_id = found
        started = time.monotonic()
        state: GatewayState = scope["app"].state.gateway
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        response: Response
        try:
            admit(state, endpoint.route, client_credentials(headers), scope.get("client"))
            raw = b""
            if endpoint.body != "none":
                raw = await read_asgi_body(
                    receive, headers.get("content-length"), state.settings.max_body_bytes
                )
            work = handle_request(state, endpoint, headers, raw, started, response_id=response_id)
            if state.dispatcher.policy.may_hold:
                response = await _unless_client_leaves(work, receive)
            else:
                response = await work
        except ClientGoneError:
            return
        except ApiError as exc:
            response = error_response(exc, endpoint.errors)
        except Exception:
            log.exception("unhandled error on %s", scope["path"])
            response = error_response(
                ApiError(500, "internal error in kvgate", error_type="server_error"),
                endpoint.errors,
            )
        await response(scope, receive, send)
