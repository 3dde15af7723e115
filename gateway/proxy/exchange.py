"""One client request on its way through the gateway (:class:`Exchange`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from gateway.core.types import RequestInfo
from gateway.policies.router_queues import QueuedRequest
from gateway.proxy.endpoints import ENDPOINTS, Endpoint
from gateway.tracing import TRACE_HEADERS, RequestTrace

__all__ = ["FORWARD_HEADERS", "Exchange"]

FORWARD_HEADERS = ("x-vllm-priority", "x-session-id", *TRACE_HEADERS)
"""Client headers passed on to the engine (trace context always, tracing on or off);
nothing else of the client's is forwarded."""
_JSON = "application/json"
_CHAT = ENDPOINTS["/v1/chat/completions"]


@dataclass(slots=True)
class Exchange:
    """One client request on its way through the gateway."""

    route: str
    path: str
    raw: bytes
    info: RequestInfo
    model: str | None
    stream: bool
    request_id: str
    client_headers: dict[str, str] = field(default_factory=dict)
    started: float = 0.0
    attempts: int = 0
    engine: str | None = None
    held: asyncio.Future[QueuedRequest] | None = None
    body: dict[str, Any] | None = None
    payload: bytes = b""
    """What goes to the (decode) engine: ``raw``, or the decode leg's body in P/D."""
    prefill_engine: str | None = None
    """The engine that ran this attempt's remote prefill leg (P/D), if any."""
    pd_reason: str | None = None
    """Why the prefill ran where it did (P/D; ``unified`` without a prefill pool)."""
    endpoint: Endpoint = _CHAT
    method: str = "POST"
    content_type: str = _JSON
    pinned: str = ""
    """The one engine this request may go to (it holds the stored response it names)."""
    response_id: str = ""
    """The stored response a ``/v1/responses/{id}`` request names."""
    store_response: bool = False
    """A Responses request that asks the engine to store its answer: bind its id."""
    trace: RequestTrace | None = None
    """Its spans (:mod:`gateway.tracing`); None when tracing is off."""
