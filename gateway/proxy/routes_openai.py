"""OpenAI-compatible routes: completions, chat completions, models."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from gateway.core.types import RequestInfo
from gateway.proxy.deps import GatewayState, get_state, read_body, require_client_key
from gateway.proxy.errors import ApiError
from gateway.proxy.forwarder import FORWARD_HEADERS, Exchange
from gateway.proxy.routing_key import completion_prompt
from gateway.proxy.schemas import ChatBody, CompletionBody, parse_json_object, validate

router = APIRouter(dependencies=[Depends(require_client_key)])

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def resolve_model(state: GatewayState, model: str | None) -> str | None:
    """The model to route on; 404 for an unknown one, 503 when nothing is up."""
    served = state.registry.models()
    if not served:
        raise ApiError(503, "no healthy engine is available", headers={"Retry-After": "1"})
    if model is None:
        if len(served) == 1:
            return served[0]
        raise ApiError(
            400, "model is required: this gateway serves " + ", ".join(served), param="model"
        )
    if model not in served:
        raise ApiError(
            404, f"The model `{model}` does not exist.", param="model", error_type="not_found_error"
        )
    return model


ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
"""The proxied routes and their metric label."""


async def handle_openai(
    state: GatewayState, path: str, headers: Mapping[str, str], raw: bytes, started: float
) -> Response:
    """Validate, key and forward one OpenAI request (shared by the fast path and FastAPI)."""
    route = ROUTES[path]
    body: dict[str, Any] = parse_json_object(raw)
    parsed = validate(ChatBody if route == "chat" else CompletionBody, body)
    model = resolve_model(state, parsed.model)
    exact = None
    if state.token_keyer is not None:
        exact = await state.token_keyer.key(route, body, model, state.keyer.block_size)
        state.metrics.keys.labels("tokens" if exact else "text_fallback").inc()
    if exact is not None:
        hashes, tokens = exact
    elif isinstance(parsed, ChatBody):
        hashes, tokens = state.keyer.chat_key(body["messages"], body.get("tools"))
    else:
        assert isinstance(parsed, CompletionBody)
        hashes, tokens = state.keyer.key(completion_prompt(parsed.prompt))
    given = headers.get("x-request-id")
    rid = given if given and _REQUEST_ID.match(given) else uuid.uuid4().hex
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    info = RequestInfo(
        id=rid,
        block_hashes=hashes,
        prompt_tokens=tokens,
        arrival=started,
        block_size=state.keyer.block_size,
        model=model or "",
        max_tokens=max_tokens if isinstance(max_tokens, int) else None,
        slo=state.slo_for(headers.get("x-kvgate-slo-class")),
    )
    exchange = Exchange(
        route=route,
        path=path,
        raw=raw,
        info=info,
        model=model,
        stream=parsed.stream,
        request_id=rid,
        started=started,
        client_headers={k: headers[k] for k in FORWARD_HEADERS if k in headers},
        body=body,
    )
    return await state.forwarder.forward(exchange)


async def _fastapi_handle(request: Request) -> Response:
    """The same handler behind FastAPI's router (used when the fast path is bypassed)."""
    started = time.monotonic()
    state = get_state(request)
    raw = await read_body(request, state.settings.max_body_bytes)
    headers = {k.lower(): v for k, v in request.headers.items()}
    return await handle_openai(state, request.url.path, headers, raw, started)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    """OpenAI completions, proxied (served by :class:`~gateway.proxy.fastpath.OpenAIFastPath`)."""
    return await _fastapi_handle(request)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions, proxied (served by the fast path)."""
    return await _fastapi_handle(request)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    state = get_state(request)
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "kvgate"}
        for m in state.registry.models()
    ]
    return JSONResponse({"object": "list", "data": data})
