"""Spans for the endpoint picker (``tracing.enabled``; the ``tracing`` extra).

One SERVER span per request the picker routes, named like ``kvgate serve``'s (``POST
/v1/chat/completions``) and with its attributes (route, model, request id, policy, reason,
engine, expected hit tokens, P/D mode, outcome): it opens when the request's body is
complete, is the child of the client's ``traceparent`` when the request carried a valid
one, and ends when the response's end settles the request (or the request is refused,
released or shut down). The pick sets ``traceparent`` (and the client's ``tracestate``) on
the request Envoy forwards to the span's own context, so the spans the engine exports are
children of the picker's, as they are of the proxy's call span behind ``kvgate serve``.
With tracing off nothing here is imported or built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gateway.tracing import RequestTrace
from gateway.tracing.config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

__all__ = ["PickTracing"]


class PickTracing:
    """The picker's tracer (``provider``: a caller's, e.g. a test's in-memory exporter;
    else one exporting over OTLP, flushed by :meth:`shutdown`)."""

    def __init__(self, cfg: TracingConfig, provider: TracerProvider | None = None) -> None:
        from gateway.tracing.otel import OtelTracing

        self.tracing = OtelTracing(cfg, provider)

    def begin(self, headers: Mapping[str, str], method: str, route: str, path: str) -> RequestTrace:
        """The span of one request (``headers``: its ext_proc request headers)."""
        from gateway.tracing.otel import server_trace

        return server_trace(self.tracing, headers, method, route, path)

    def shutdown(self) -> None:
        self.tracing.shutdown()
