"""Global admission cap: at most ``max_in_flight`` proxied requests in the gateway at once.

Installed only when ``max_in_flight`` is set. It counts a request from the
moment it reaches the proxied routes until its response (a whole stream
included) has been sent, so held requests count too. Past the cap a request
gets 503 ``service_unavailable`` with ``Retry-After: 1`` at once, before its
body is read: under overload the gateway sheds load instead of queueing
without bound in front of saturated engines.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.observability import GatewayMetrics
from gateway.proxy.endpoints import match
from gateway.proxy.errors import ApiError, error_response


class InFlightCap:
    """ASGI middleware counting the proxied requests in flight."""

    def __init__(self, app: ASGIApp, *, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or match(scope["method"], scope["path"]) is None:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            _count(scope)
            response = error_response(
                ApiError(
                    503,
                    f"the gateway is at its limit of {self.limit} requests in flight; retry later",
                    headers={"Retry-After": "1"},
                )
            )
            await response(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def _count(scope: Scope) -> None:
    state = getattr(getattr(scope.get("app"), "state", None), "gateway", None)
    metrics = getattr(state, "metrics", None)
    if isinstance(metrics, GatewayMetrics):
        metrics.overloaded.inc()
        policy = str(getattr(getattr(state, "forwarder", None), "policy", "unknown"))
        found = match(scope["method"], scope["path"])
        route = found[0].route if found is not None else "unknown"
        metrics.requests.labels(route, policy, "overloaded").inc()
