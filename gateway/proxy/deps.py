"""Per-app state and request dependencies (auth, body reading)."""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import httpx
from fastapi import Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from gateway.cluster.kv_events import KVEventSubscriber
from gateway.cluster.monitor import EngineMonitor
from gateway.cluster.registry import EngineRegistry
from gateway.config import Settings
from gateway.core.types import SloClass
from gateway.observability import GatewayMetrics
from gateway.policies.dispatcher import Dispatcher
from gateway.proxy.errors import ApiError
from gateway.proxy.forwarder import Forwarder
from gateway.proxy.ratelimit import RateLimiter
from gateway.proxy.routing_key import RoutingKeyer
from gateway.proxy.token_keys import TokenKeyer

if TYPE_CHECKING:  # the service imports modules that import this one
    from gateway.proxy.service import RoutingService


@dataclass(slots=True)
class GatewayState:
    """Everything the routes use, built in the app's lifespan."""

    settings: Settings
    client: httpx.AsyncClient
    registry: EngineRegistry
    dispatcher: Dispatcher
    metrics: GatewayMetrics
    monitor: EngineMonitor
    forwarder: Forwarder
    keyer: RoutingKeyer
    service: RoutingService
    """The routing service the fields above come from (shared with other front ends)."""
    token_keyer: TokenKeyer | None = None
    kv_events: KVEventSubscriber | None = None
    limiter: RateLimiter | None = None
    """Per-client rate limit (``rate_limit``); None when off."""

    def slo_for(self, name: str | None) -> SloClass:
        """The SLO class a request asked for (header ``x-kvgate-slo-class``), or the default."""
        return self.service.slo_for(name)


def get_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(secret: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(secret.encode(), given.encode())


_CLIENT_KEY = HTTPBearer(
    auto_error=False,
    scheme_name="clientKey",
    description="one of `api_keys` (only when client keys are configured)",
)
_ADMIN_BEARER = HTTPBearer(
    auto_error=False, scheme_name="adminKey", description="`admin_key` as a Bearer token"
)
_ADMIN_HEADER = APIKeyHeader(
    name="X-Admin-Key", auto_error=False, scheme_name="adminKeyHeader", description="`admin_key`"
)


async def require_client_key(
    request: Request,
    _documented: Annotated[HTTPAuthorizationCredentials | None, Security(_CLIENT_KEY)],
) -> None:
    """When client API keys are configured, one of them must come as a Bearer token; then the
    client's rate limit (``rate_limit``). The POST routes do the same in the fast path."""
    from gateway.proxy.fastpath import admit

    route = request.url.path.rsplit("/", 1)[-1] or "v1"
    admit(get_state(request), route, request.headers.get("authorization"), request.client)


async def require_admin(
    request: Request,
    _bearer_doc: Annotated[HTTPAuthorizationCredentials | None, Security(_ADMIN_BEARER)],
    _header_doc: Annotated[str | None, Security(_ADMIN_HEADER)],
) -> None:
    """Admin routes: the admin key when configured, else loopback callers only. Client keys
    never open them (they are compared with ``admin_key`` only)."""
    admin = get_state(request).settings.admin_key
    if admin is not None:
        given = _bearer(request) or request.headers.get("x-admin-key")
        if not _matches(admin.get_secret_value(), given):
            raise ApiError(401, "admin key required", headers={"WWW-Authenticate": "Bearer"})
        return
    host = request.client.host if request.client else ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host in {"localhost", "testclient"}
    if not loopback:
        raise ApiError(403, "admin routes need an admin key when called from another host")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes with a 413."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise ApiError(413, f"request body is larger than {limit} bytes")
        except ValueError:
            raise ApiError(400, "invalid Content-Length header") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
