"""``create_app(settings)``: the HTTP front end. Its lifespan builds the routing service
(:class:`~gateway.proxy.service.RoutingService`) and the forwarder on top of it."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gateway.config import Settings
from gateway.proxy import decision_log, routes_admin, routes_openai
from gateway.proxy.deps import GatewayState
from gateway.proxy.errors import install_handlers
from gateway.proxy.fastpath import OpenAIFastPath
from gateway.proxy.forwarder import Forwarder
from gateway.proxy.overload import InFlightCap
from gateway.proxy.service import RoutingService

log = logging.getLogger("kvgate")


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """``GET /openapi.json``: FastAPI's schema, less the 422s it documents for parameter
    errors (kvgate answers those 400, OpenAI-shaped)."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider


_NO_FRAMEWORK_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)
"""FastAPI's own OpenTelemetry (0.165 and later) off: kvgate's spans and metrics are its own
(``gateway.tracing``), and FastAPI's looked up the global providers on every request."""


def create_app(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    tracer_provider: TracerProvider | None = None,
) -> FastAPI:
    """The gateway app. ``transport`` replaces the network in tests, ``tracer_provider``
    the OTLP exporter of ``tracing`` (when enabled)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = RoutingService(settings, transport=transport)
        forwarder = Forwarder(
            settings,
            service.upstream,
            service.registry,
            service.dispatcher,
            service.metrics,
            responses=service.responses,
            pump=service.pump,
            flow=service.flow,
        )
        forwarder.on_model_missing = service.monitor.refresh_models_soon  # a 404: re-read
        service.tick = forwarder.pump  # the timer wakes what the forwarder holds
        app.state.gateway = GatewayState(
            settings=settings,
            client=service.client,
            registry=service.registry,
            dispatcher=service.dispatcher,
            metrics=service.metrics,
            monitor=service.monitor,
            forwarder=forwarder,
            keyer=service.keyer,
            token_keyer=service.token_keyer,
            limiter=service.limiter,
            service=service,
        )
        await service.start()
        forwarder.recorder = service.recorder
        app.state.gateway.kv_events = service.kv_events
        app.state.replica_sync = service.replica_sync  # tests and admin read it here
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(
        title="kvgate",
        version="0.1.0",
        description="OpenAI-compatible KV-cache-aware routing gateway for vLLM engines",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        **_NO_FRAMEWORK_TELEMETRY,
    )
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    install_handlers(app)
    app.add_middleware(OpenAIFastPath)
    if settings.max_in_flight is not None:  # outermost: counts whole responses, streams too
        app.add_middleware(InFlightCap, limit=settings.max_in_flight)
    from gateway.proxy.tracing_asgi import install_tracing  # (beside its one use)

    install_tracing(app, settings.tracing, tracer_provider)  # outermost; nothing when off
    app.include_router(routes_openai.router)
    app.include_router(routes_admin.router)
    app.include_router(routes_admin.admin)
    app.include_router(decision_log.admin)
    return app
