"""OpenTelemetry spans for proxied requests (imported only when ``tracing.enabled``).

One SERVER span per proxied request, opened by :class:`TracingMiddleware` when the request
arrives and closed when its response (a whole stream included) has been sent. Its parent is
the client's ``traceparent`` when the client sent a valid one, so the gateway's spans join
the client's trace; otherwise the span starts a new trace. The sampler is
``ParentBased(TraceIdRatioBased(sample_ratio))``: a client's sampled flag decides for its
request, ``sample_ratio`` for new traces.

Each upstream call is a CLIENT child of the server span: ``kvgate.attempt`` per attempt on a
unified pool, ``kvgate.prefill`` and ``kvgate.decode`` for the two legs of a disaggregated
request (a retry makes another one). Each call's own context goes to the engine in
``traceparent`` / ``tracestate`` (the client's ``baggage`` is passed as it came), so the
spans vLLM exports with ``--otlp-traces-endpoint`` are children of the call that reached it.

Spans leave through a ``BatchSpanProcessor`` (at most ``max_queue_size`` waiting; more are
dropped and counted by the SDK), exported over OTLP gRPC or HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from opentelemetry.context import Context
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    TracerProvider,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.core.errors import ConfigError
from gateway.tracing import RequestTrace, TracedExchange, current_request
from gateway.tracing.config import TracingConfig

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "OtelRequestTrace",
    "OtelTracing",
    "TracingMiddleware",
    "build_provider",
    "server_trace",
]

_PROPAGATOR = TraceContextTextMapPropagator()
_CONTEXT_HEADERS = frozenset({"traceparent", "tracestate"})


def build_provider(cfg: TracingConfig) -> TracerProvider:
    """An SDK tracer provider exporting to ``cfg``'s OTLP collector in batches."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanProcessor
        from opentelemetry.sdk.trace import TracerProvider as SdkProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        exporter: SpanExporter
        if cfg.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=cfg.url, insecure=cfg.url.startswith("http://"))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as OTLPHttpSpanExporter,
            )

            exporter = OTLPHttpSpanExporter(endpoint=cfg.url)
    except ImportError as exc:
        if (exc.name or "").startswith("opentelemetry.proto"):  # present, but not its own files
            raise ConfigError(
                f"tracing.enabled: {exc}. Another package (xds-protos ships an old copy) "
                "overwrote opentelemetry-proto's modules: pip install --force-reinstall "
                "--no-deps opentelemetry-proto"
            ) from None
        raise ConfigError(
            f"tracing.enabled needs OpenTelemetry ({exc.name} is missing): "
            "pip install 'kvgate[tracing]'"
        ) from None
    provider = SdkProvider(
        resource=Resource.create({"service.name": cfg.service_name}),
        sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
    )
    processor: SpanProcessor = BatchSpanProcessor(
        exporter,
        max_queue_size=cfg.max_queue_size,
        schedule_delay_millis=cfg.schedule_delay_s * 1000,
        max_export_batch_size=min(512, cfg.max_queue_size),
    )
    provider.add_span_processor(processor)
    return provider


class OtelTracing:
    """The gateway's tracer; ``shutdown`` flushes a provider it built itself."""

    def __init__(self, cfg: TracingConfig, provider: TracerProvider | None = None) -> None:
        self.owned = provider is None
        self.provider = build_provider(cfg) if provider is None else provider
        self.tracer: Tracer = self.provider.get_tracer("kvgate")

    def shutdown(self) -> None:
        shutdown = getattr(self.provider, "shutdown", None)
        if self.owned and shutdown is not None:
            shutdown()


class OtelRequestTrace(RequestTrace):
    """:class:`~gateway.tracing.RequestTrace` over one server span."""

    __slots__ = ("_context", "_leg", "_tracer", "_waited", "server")

    def __init__(self, tracer: Tracer, server: Span) -> None:
        self._tracer = tracer
        self.server = server
        self._context: Context = set_span_in_context(server)
        self._leg: Span | None = None
        self._waited = 0.0

    def request(self, ex: TracedExchange) -> None:
        self.server.set_attributes(
            {
                "kvgate.route": ex.route,
                "kvgate.request_id": ex.request_id,
                "kvgate.stream": ex.stream,
                "gen_ai.request.model": ex.model or "",
            }
        )

    def decided(
        self, policy: str, reason: str | None, engine: str, hit_tokens: int, pd: str | None
    ) -> None:
        self.server.set_attributes(
            {
                "kvgate.policy": policy,
                "kvgate.decision.reason": reason or "none",
                "kvgate.engine": engine,
                "kvgate.expected_hit_tokens": hit_tokens,
                "kvgate.pd.mode": pd or "unified",
            }
        )

    def queue_wait(self, seconds: float) -> None:
        self._waited += seconds
        self.server.set_attribute("kvgate.queue_wait_s", self._waited)

    def begin_leg(self, leg: str, engine: str, attempt: int) -> None:
        if self._leg is not None:  # a call left open (cannot happen on kvgate's own paths)
            self.end_leg(error="superseded")
        if leg != "prefill":
            self.server.set_attributes({"kvgate.attempts": attempt, "kvgate.retries": attempt - 1})
        self._leg = self._tracer.start_span(
            f"kvgate.{leg}",
            context=self._context,
            kind=SpanKind.CLIENT,
            attributes={"kvgate.leg": leg, "kvgate.engine": engine, "kvgate.attempt": attempt},
        )

    def end_leg(self, *, error: str | None = None, status: int | None = None) -> None:
        span, self._leg = self._leg, None
        if span is None:
            return
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def headers(self, client: dict[str, str]) -> dict[str, str]:
        carrier = {k: v for k, v in client.items() if k not in _CONTEXT_HEADERS}
        span = self._leg if self._leg is not None else self.server
        _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
        return carrier

    def finished(self, ex: TracedExchange, outcome: str) -> None:
        self.end_leg(error=None if outcome == "ok" else outcome)
        self.server.set_attribute("kvgate.outcome", outcome)
        if ex.engine is not None:
            self.server.set_attribute("kvgate.engine", ex.engine)
        if ex.pd_reason is not None and ex.pd_reason != "unified":
            self.server.set_attribute("kvgate.pd.prefill_engine", ex.prefill_engine or "local")

    def close(self, status: int | None) -> None:
        """End the request: any call still open (a cancelled request), then the server span."""
        if self._leg is not None:
            self.end_leg(error="cancelled")
        if status is None:
            self.server.set_status(Status(StatusCode.ERROR, "no response"))
        else:
            self.server.set_attribute("http.response.status_code", status)
            current = getattr(self.server, "status", None)  # an SDK span's; kept when set
            if status >= 500 and current is not None and current.status_code is StatusCode.UNSET:
                self.server.set_status(Status(StatusCode.ERROR))
        self.server.end()


def server_trace(
    tracing: OtelTracing, headers: Mapping[str, str], method: str, route: str, path: str
) -> OtelRequestTrace:
    """A request's SERVER span, the child of the client's ``traceparent`` in ``headers``
    (lower-case names) when it sent a valid one, else the root of a new trace."""
    carrier = {k: v for k, v in headers.items() if k in _CONTEXT_HEADERS}
    parent = _PROPAGATOR.extract(carrier) if carrier else None
    span = tracing.tracer.start_span(
        f"{method} {route}",
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"http.request.method": method, "http.route": route, "url.path": path},
    )
    return OtelRequestTrace(tracing.tracer, span)


class TracingMiddleware:
    """Pure ASGI: a server span around each request ``traced`` names a route for."""

    def __init__(
        self, app: ASGIApp, *, tracing: OtelTracing, traced: Callable[[str, str], str | None]
    ) -> None:
        self.app = app
        self.tracing = tracing
        self.traced = traced

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.traced(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        carrier: dict[str, str] = {}
        for key, value in scope["headers"]:
            name = key.decode("latin-1").lower()
            if name in _CONTEXT_HEADERS:
                carrier[name] = value.decode("latin-1")
        trace = server_trace(self.tracing, carrier, scope["method"], route, scope["path"])
        span = trace.server
        token = current_request.set(trace)
        status: int | None = None

        async def traced_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            if not isinstance(span, NonRecordingSpan):
                span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            current_request.reset(token)
            trace.close(status)
