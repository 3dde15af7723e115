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
from gateway.proxy.schemas import (
    ChatBody,
    CompletionBody,
    ErrorResponse,
    body_schema,
    parse_json_object,
    validate,
)

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
        if model in state.registry.known_models():  # its engines are all down or tripped
            raise ApiError(
                503, f"no healthy engine serves `{model}` right now", headers={"Retry-After": "1"}
            )
        raise ApiError(
            404, f"The model `{model}` does not exist.", param="model", error_type="not_found_error"
        )
    return model


ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
"""The proxied routes and their metric label."""

GATEWAY_OWNED_FIELDS = ("kv_transfer_params",)
"""Body fields only kvgate may set: vLLM's ``kv_transfer_params`` name the host and port an
engine pulls KV from (P/D), so a client's would make an engine connect where it says."""


def forwarded_client_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client headers passed on (``FORWARD_HEADERS``), less any the client's
    ``Connection`` header names (hop-by-hop by RFC 9110 §7.6.1)."""
    out = {k: headers[k] for k in FORWARD_HEADERS if k in headers}
    connection = headers.get("connection")
    if out and connection:
        for token in connection.split(","):
            out.pop(token.strip().lower(), None)
    return out


async def handle_openai(
    state: GatewayState, path: str, headers: Mapping[str, str], raw: bytes, started: float
) -> Response:
    """Validate, key and forward one OpenAI request (shared by the fast path and FastAPI)."""
    route = ROUTES[path]
    body: dict[str, Any] = parse_json_object(raw)
    parsed = validate(ChatBody if route == "chat" else CompletionBody, body)
    for name in GATEWAY_OWNED_FIELDS:
        if name in body:
            raise ApiError(400, f"{name} is set by kvgate, not by clients", param=name)
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
        client_headers=forwarded_client_headers(headers),
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


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("invalid request (the field is named in `param`), or the engine's own 400"),
    401: _error("missing or invalid client API key (when `api_keys` are configured)"),
    429: _error("rate limited (`rate_limit`) or router queues full; see Retry-After"),
    503: _error("no healthy engine serves the model, or every attempt failed; Retry-After: 1"),
}
_PROXY_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the engine's answer: JSON, or server-sent events with `stream: true`",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {  # one schema per event; data: a JSON chunk or [DONE]
                "schema": {
                    "type": "object",
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                    "required": ["data"],
                }
            },
        },
    },
    **ERROR_RESPONSES,
    404: _error("the model is not served by any healthy engine (the engine's 404 likewise)"),
    413: _error("the body is larger than `max_body_bytes`"),
    "4XX": _error("any other client error an engine answers, passed through unchanged"),
}


def _request_body(model_cls: type[ChatBody] | type[CompletionBody]) -> dict[str, Any]:
    schema = body_schema(model_cls)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# The fast path serves these two routes before FastAPI routing; they stay here as the
# fallback and so that the OpenAPI schema (GET /openapi.json) describes them.
@router.post(
    "/v1/completions",
    response_class=Response,
    responses=_PROXY_RESPONSES,
    openapi_extra=_request_body(CompletionBody),
)
async def completions(request: Request) -> Response:
    """OpenAI completions, proxied (served by :class:`~gateway.proxy.fastpath.OpenAIFastPath`).

    Only the fields kvgate reads are validated; the rest goes to the engine unchanged."""
    return await _fastapi_handle(request)


@router.post(
    "/v1/chat/completions",
    response_class=Response,
    responses=_PROXY_RESPONSES,
    openapi_extra=_request_body(ChatBody),
)
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions, proxied (served by the fast path)."""
    return await _fastapi_handle(request)


@router.get("/v1/models", responses={401: ERROR_RESPONSES[401], 429: ERROR_RESPONSES[429]})
async def models(request: Request) -> JSONResponse:
    """The union of the models healthy engines serve."""
    state = get_state(request)
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "kvgate"}
        for m in state.registry.models()
    ]
    return JSONResponse({"object": "list", "data": data})
