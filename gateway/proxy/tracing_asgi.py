"""Install OpenTelemetry tracing on the gateway app when ``tracing.enabled``.

With tracing off this does nothing: no middleware, no OpenTelemetry import, no span (the
forwarder still forwards the client's trace headers, :data:`gateway.tracing.TRACE_HEADERS`).
With it on, :class:`gateway.tracing.otel.TracingMiddleware` wraps the whole app (outermost,
so a request the in-flight cap refuses is traced too) and the tracer provider is flushed
and shut down after the app's lifespan ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from gateway.proxy.endpoints import match
from gateway.tracing.config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

__all__ = ["install_tracing", "traced_route"]


def traced_route(method: str, path: str) -> str | None:
    """The route a span is named after (``/v1/responses/{id}`` for stored responses), or
    None for a path kvgate does not proxy (admin, metrics, health: never traced)."""
    found = match(method, path)
    return found[0].path if found is not None else None


def install_tracing(
    app: FastAPI, cfg: TracingConfig, provider: TracerProvider | None = None
) -> None:
    """Trace ``app``'s proxied requests per ``cfg`` (``provider``: a caller's, e.g. a test's
    in-memory exporter; else one exporting over OTLP is built and shut down with the app)."""
    if not cfg.enabled:
        return
    from gateway.tracing.otel import OtelTracing, TracingMiddleware

    tracing = OtelTracing(cfg, provider)
    app.add_middleware(TracingMiddleware, tracing=tracing, traced=traced_route)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[Any]:
        try:
            async with inner(app) as state:
                yield state
        finally:
            tracing.shutdown()  # flushes the spans still queued

    app.router.lifespan_context = lifespan
