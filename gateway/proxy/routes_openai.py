"""The documented proxied routes (OpenAI, Anthropic Messages, pooling, tokenize, audio,
stored responses) and ``GET /v1/models``.

The fast path (:class:`~gateway.proxy.fastpath.OpenAIFastPath`) serves every proxied
route before FastAPI routing; the routes here are its fallback and what the OpenAPI
schema (``GET /openapi.json``) describes.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from gateway.proxy.deps import get_state, read_body, require_client_key
from gateway.proxy.endpoints import ENDPOINTS, STORED_CANCEL, STORED_DELETE, STORED_GET, Endpoint
from gateway.proxy.intake import handle_request
from gateway.proxy.schemas import (
    ChatBody,
    CompletionBody,
    ErrorResponse,
    MessagesBody,
    PooledBody,
    ResponsesBody,
    body_schema,
)

router = APIRouter(dependencies=[Depends(require_client_key)])


async def _fastapi_handle(request: Request, endpoint: Endpoint, response_id: str = "") -> Response:
    """The fast path's handler behind FastAPI's router (used when the fast path is bypassed)."""
    started = time.monotonic()
    state = get_state(request)
    raw = b""
    if endpoint.body != "none":
        raw = await read_body(request, state.settings.max_body_bytes)
    headers = {k.lower(): v for k, v in request.headers.items()}
    return await handle_request(state, endpoint, headers, raw, started, response_id=response_id)


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


_BODY_MODELS: dict[str, type[Any]] = {
    "completions": CompletionBody,
    "chat": ChatBody,
    "responses": ResponsesBody,
    "messages": MessagesBody,
    "count_tokens": MessagesBody,
}
_MULTIPART = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "model": {"type": "string"},
                    },
                    "required": ["file"],
                }
            }
        },
    }
}
_SUMMARIES = {
    "completions": "OpenAI completions",
    "chat": "OpenAI chat completions",
    "responses": "OpenAI Responses (stored responses stay on the engine that made them)",
    "messages": "Anthropic Messages (kvgate's own errors in Anthropic's shape)",
    "count_tokens": "Anthropic Messages token count",
}


def _openapi_extra(endpoint: Endpoint) -> dict[str, Any]:
    if endpoint.body == "multipart":
        return _MULTIPART
    schema = body_schema(_BODY_MODELS.get(endpoint.route, PooledBody))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _post_route(endpoint: Endpoint) -> None:
    async def proxied(request: Request) -> Response:
        return await _fastapi_handle(request, endpoint)

    kind = "prefix-keyed" if endpoint.kind == "prefix" else "load-balanced"
    summary = _SUMMARIES.get(endpoint.route, f"vLLM {endpoint.path}")
    router.add_api_route(
        endpoint.path,
        proxied,
        methods=["POST"],
        response_class=Response,
        responses=_PROXY_RESPONSES,
        openapi_extra=_openapi_extra(endpoint),
        name=f"proxy_{endpoint.path.strip('/').replace('/', '_')}",
        summary=summary,
        description=f"Proxied to an engine serving the model ({kind}); the body goes "
        "to the engine unchanged after the fields kvgate reads are validated.",
    )


for _endpoint in ENDPOINTS.values():
    _post_route(_endpoint)


_STORED_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the engine's answer", "content": {"application/json": {}}},
    **ERROR_RESPONSES,
    404: _error("no engine of this gateway stored the response, or its engine left the fleet"),
    "4XX": _error("any other client error an engine answers, passed through unchanged"),
}


@router.get("/v1/responses/{response_id}", response_class=Response, responses=_STORED_RESPONSES)
async def get_response(request: Request, response_id: str) -> Response:
    """A stored response, from the engine that stored it."""
    return await _fastapi_handle(request, STORED_GET, response_id)


@router.delete("/v1/responses/{response_id}", response_class=Response, responses=_STORED_RESPONSES)
async def delete_response(request: Request, response_id: str) -> Response:
    """Delete a stored response on the engine that stored it (where vLLM supports it)."""
    return await _fastapi_handle(request, STORED_DELETE, response_id)


@router.post(
    "/v1/responses/{response_id}/cancel", response_class=Response, responses=_STORED_RESPONSES
)
async def cancel_response(request: Request, response_id: str) -> Response:
    """Cancel a background response on the engine running it."""
    return await _fastapi_handle(request, STORED_CANCEL, response_id)


@router.get("/v1/models", responses={401: ERROR_RESPONSES[401], 429: ERROR_RESPONSES[429]})
async def models(request: Request) -> JSONResponse:
    """The union of the models healthy engines serve (LoRA adapters name their base model in
    ``parent``)."""
    state = get_state(request)
    data = []
    for m in state.registry.models():
        card: dict[str, Any] = {"id": m, "object": "model", "created": 0, "owned_by": "kvgate"}
        adapter = state.registry.lora_adapter(m)
        if adapter is not None:  # as vLLM lists it: the base model and the adapter's path
            card["parent"] = adapter.base
            card["root"] = adapter.path
        data.append(card)
    return JSONResponse({"object": "list", "data": data})
