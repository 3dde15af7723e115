"""Trace context for proxied requests: what is always forwarded, and the seam for spans.

``TRACE_HEADERS`` (W3C ``traceparent`` and ``tracestate``, and ``baggage``) reach every
engine call, prefill and decode legs included, whether tracing is on or off. With
``tracing.enabled`` the ASGI middleware of :mod:`gateway.proxy.tracing_asgi` opens a
server span per proxied request and publishes a :class:`RequestTrace` in
:data:`current_request` for the request's context; the forwarder reads it once per request
(:func:`begin_request`) and reports its decisions, attempts and legs to it. With tracing
off nothing sets it: the forwarder sees ``None`` and skips every tracing call, and no
OpenTelemetry module is imported (:mod:`gateway.tracing.otel` is imported only by
:func:`gateway.proxy.tracing_asgi.install_tracing` when tracing is on).

:data:`current_request` is a context variable, not shared state: each request's context
holds its own trace, and tasks started for a request copy it.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Protocol

__all__ = ["TRACE_HEADERS", "RequestTrace", "TracedExchange", "begin_request", "current_request"]

TRACE_HEADERS = ("traceparent", "tracestate", "baggage")
"""Client headers always forwarded to the engines (W3C Trace Context and Baggage)."""


class TracedExchange(Protocol):
    """What a trace reads of a request (a :class:`gateway.proxy.exchange.Exchange`)."""

    @property
    def route(self) -> str: ...
    @property
    def model(self) -> str | None: ...
    @property
    def request_id(self) -> str: ...
    @property
    def stream(self) -> bool: ...
    @property
    def attempts(self) -> int: ...
    @property
    def engine(self) -> str | None: ...
    @property
    def prefill_engine(self) -> str | None: ...
    @property
    def pd_reason(self) -> str | None: ...


class RequestTrace(Protocol):
    """The spans of one proxied request: its server span and one child per upstream call."""

    def request(self, ex: TracedExchange) -> None:
        """The request reached the forwarder (route, model, request id)."""

    def decided(
        self, policy: str, reason: str | None, engine: str, hit_tokens: int, pd: str | None
    ) -> None:
        """The policy chose ``engine`` (an attempt's decision; the last one stays)."""

    def queue_wait(self, seconds: float) -> None:
        """The request waited ``seconds`` in a gateway queue (added up)."""

    def begin_leg(self, leg: str, engine: str, attempt: int) -> None:
        """An upstream call starts: ``leg`` is ``attempt`` (unified), ``prefill`` or
        ``decode``; the headers built next carry this call's span context."""

    def end_leg(self, *, error: str | None = None, status: int | None = None) -> None:
        """The open upstream call ended (``error``: why it failed)."""

    def headers(self, client: dict[str, str]) -> dict[str, str]:
        """``client`` (the forwarded client headers) with the open call's trace context."""

    def finished(self, ex: TracedExchange, outcome: str) -> None:
        """An engine answered the request (``outcome`` as in kvgate_requests_total)."""

    def close(self, status: int | None) -> None:
        """The request is over (``status``: the client's HTTP status; None: no response):
        any call still open, then the request's own span, end."""


current_request: ContextVar[RequestTrace | None] = ContextVar("kvgate_request_trace", default=None)


def begin_request(ex: TracedExchange) -> RequestTrace | None:
    """The trace of the request ``ex`` belongs to (None when tracing is off)."""
    trace = current_request.get()
    if trace is not None:
        trace.request(ex)
    return trace
