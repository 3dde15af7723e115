"""From client request to :class:`~gateway.proxy.forwarder.Exchange`: one handler for every
proxied endpoint (:mod:`gateway.proxy.endpoints`).

It validates the fields kvgate reads, resolves the model (a LoRA adapter is a model
name too), keys the prompt in its cache partition (adapter, ``cache_salt``), finds the
engine a stored response lives on (:func:`build_exchange`, shared by every front end),
and hands the exchange to the forwarder (:func:`handle_request`). The body is forwarded
byte for byte.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi.responses import Response

from gateway.core.types import RequestInfo
from gateway.proxy.deps import GatewayState
from gateway.proxy.endpoints import Endpoint
from gateway.proxy.errors import ApiError
from gateway.proxy.exchange import FORWARD_HEADERS, Exchange
from gateway.proxy.flow_gate import identify
from gateway.proxy.forms import form_field
from gateway.proxy.render import messages_messages, responses_messages
from gateway.proxy.routing_key import completion_prompt
from gateway.proxy.schemas import (
    ChatBody,
    CompletionBody,
    MessagesBody,
    PooledBody,
    ResponsesBody,
    parse_json_object,
    validate,
)
from gateway.proxy.service import RoutingService
from gateway.proxy.sessions import session_id

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

_BODIES: dict[str, type[Any]] = {
    "completions": CompletionBody,
    "chat": ChatBody,
    "responses": ResponsesBody,
    "messages": MessagesBody,
    "count_tokens": MessagesBody,
}

GATEWAY_OWNED_FIELDS = ("kv_transfer_params",)
"""Body fields only kvgate may set: vLLM's ``kv_transfer_params`` name the host and port an
engine pulls KV from (P/D), so a client's would make an engine connect where it says."""


def resolve_model(state: RoutingService, model: str | None) -> str | None:
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


def forwarded_client_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client headers passed on (``FORWARD_HEADERS``), less any the client's
    ``Connection`` header names (hop-by-hop by RFC 9110 §7.6.1)."""
    out = {k: headers[k] for k in FORWARD_HEADERS if k in headers}
    connection = headers.get("connection")
    if out and connection:
        for token in connection.split(","):
            out.pop(token.strip().lower(), None)
    return out


def _max_tokens(route: str, body: Mapping[str, Any]) -> int | None:
    if route == "responses":
        value = body.get("max_output_tokens")
    elif route == "count_tokens":
        value = 0
    else:
        value = body.get("max_completion_tokens", body.get("max_tokens"))
    return value if isinstance(value, int) else None


async def _prefix_key(
    state: RoutingService,
    route: str,
    body: dict[str, Any],
    parsed: Any,
    *,
    model: str | None,
    lora: str,
) -> tuple[tuple[int, ...], int]:
    """(block hashes, prompt tokens) of a generation request, in its cache partition."""
    salt = body.get("cache_salt") or ""
    if state.token_keyer is not None:
        exact = await state.token_keyer.key(route, body, model, state.keyer.block_size)
        state.metrics.keys.labels("tokens" if exact else "text_fallback").inc()
        if exact is not None:
            return exact
    keyer = state.keyer
    if route == "completions":
        return keyer.key(completion_prompt(parsed.prompt), lora=lora, cache_salt=salt)
    if route == "chat":
        return keyer.chat_key(body["messages"], body.get("tools"), lora=lora, cache_salt=salt)
    messages, tools = responses_messages(body) if route == "responses" else messages_messages(body)
    return keyer.chat_key(messages, tools, lora=lora, cache_salt=salt)


async def handle_request(
    state: GatewayState,
    endpoint: Endpoint,
    headers: Mapping[str, str],
    raw: bytes,
    started: float,
    *,
    response_id: str = "",
) -> Response:
    """Validate, key and forward one request to a proxied endpoint."""
    exchange = await build_exchange(
        state.service, endpoint, headers, raw, started, response_id=response_id
    )
    return await state.forwarder.forward(exchange)


async def build_exchange(
    state: RoutingService,
    endpoint: Endpoint,
    headers: Mapping[str, str],
    raw: bytes,
    started: float,
    *,
    response_id: str = "",
) -> Exchange:
    """Validate and key one request to a proxied endpoint: resolve its model, key its
    prompt, find its session and the engine it is pinned to. Every front end routes the
    exchange this returns (the HTTP proxy forwards it; the endpoint picker picks for it)."""
    route = endpoint.route
    body: dict[str, Any] = {}
    stream = False
    parsed: Any = None
    content_type = "application/json"
    if endpoint.body == "json":
        body = parse_json_object(raw)
        parsed = validate(_BODIES.get(route, PooledBody), body)
        for name in GATEWAY_OWNED_FIELDS:
            if name in body:
                raise ApiError(400, f"{name} is set by kvgate, not by clients", param=name)
        stream = parsed.stream and endpoint.streams
        requested = parsed.model
    elif endpoint.body == "multipart":
        content_type = headers.get("content-type", "")
        requested = form_field(raw, content_type, "model")
        stream = (form_field(raw, content_type, "stream") or "").lower() == "true"
    else:
        requested = None
    pinned = ""
    store = route == "responses" and bool(parsed.store)
    if endpoint.kind == "stored":
        model = None
        pinned = await _stored_engine(state, response_id, None, headers)
    else:
        model = resolve_model(state, requested)
        previous = body.get("previous_response_id") if route == "responses" else None
        if isinstance(previous, str):
            pinned = await _stored_engine(state, previous, model, headers)
    adapter = state.registry.lora_adapter(model)
    lora = adapter.name if adapter is not None else ""
    if endpoint.kind == "prefix":
        hashes, tokens = await _prefix_key(state, route, body, parsed, model=model, lora=lora)
    else:
        hashes, tokens = (), max(1, int(len(raw) / state.settings.chars_per_token))
    given = headers.get("x-request-id")
    rid = given if given and _REQUEST_ID.match(given) else uuid.uuid4().hex
    tenant, priority = identify(state.settings.flow_control, headers, body)
    info = RequestInfo(
        id=rid,
        block_hashes=hashes,
        prompt_tokens=tokens,
        arrival=started,
        block_size=state.keyer.block_size,
        model=model or "",
        max_tokens=_max_tokens(route, body) if endpoint.kind == "prefix" else 1,
        slo=state.slo_for(headers.get("x-kvgate-slo-class")),
        lora=lora,
        session=session_id(headers, body, state.settings.sessions),
        tenant=tenant,
        priority=priority,
    )
    path = endpoint.path.replace("{id}", response_id)
    return Exchange(
        route=route,
        path=path,
        raw=raw,
        info=info,
        model=model,
        stream=stream,
        request_id=rid,
        started=started,
        client_headers=forwarded_client_headers(headers),
        body=body if endpoint.body == "json" else None,
        endpoint=endpoint,
        method=endpoint.method,
        content_type=content_type,
        pinned=pinned,
        response_id=response_id,
        store_response=store,
    )


async def _stored_engine(
    state: RoutingService, response_id: str, model: str | None, headers: Mapping[str, str]
) -> str:
    """The engine holding the stored response ``response_id``; a 404 when none does."""
    store = state.responses
    engine = store.engine_for(response_id)
    if engine is None:
        engine = await store.locate(state.upstream, response_id, model, state.engine_headers)
    if engine is None:
        raise ApiError(
            404,
            f"Response with id '{response_id}' not found: no engine of this gateway stored it",
            param="previous_response_id" if model is not None else None,
            error_type="not_found_error",
        )
    return engine.id
