"""Spans of the endpoint picker (``tracing.enabled``), with the SDK's in-memory exporter.

One SERVER span per routed request, the child of the client's ``traceparent``, carrying the
decision and the outcome, ended when the response's end settles the request; the request
Envoy forwards carries the span's own context, so the engine's spans are its children.
Refusals are spans too; with tracing off the picker sets no trace header.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.epp import EppServer
from tests.epp.harness import MODEL, FakeEnvoy, FleetTransport, fleet, picker

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there " * 40}]}
CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
CLIENT = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=opaque"}


def traced() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@asynccontextmanager
async def traced_picker(
    *roles: str,
) -> AsyncIterator[tuple[EppServer, FleetTransport, list[str], InMemorySpanExporter]]:
    """A picker with tracing on, exporting to memory, over emulated engines of ``roles``."""
    provider, exporter = traced()
    async with (
        fleet(*roles) as (transport, urls),
        picker(
            transport,
            [{"url": u} for u in urls],
            tracing={"enabled": True},
            tracer_provider=provider,
        ) as server,
    ):
        yield server, transport, urls, exporter


async def ended(exporter: InMemorySpanExporter, n: int) -> tuple[ReadableSpan, ...]:
    """The first ``n`` finished spans (the native front end reports a response's end to
    the routing service after answering Envoy, so the span may end a moment later)."""
    for _ in range(500):
        spans = exporter.get_finished_spans()
        if len(spans) >= n:
            return tuple(spans)
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(exporter.get_finished_spans())} spans ended, expected {n}")


@pytest.mark.parametrize("mode", ["buffered", "duplex"])
async def test_a_routed_request_is_one_span_in_the_clients_trace(mode: str) -> None:
    async with traced_picker("both", "both") as (server, transport, _, exporter):
        envoy = FakeEnvoy(server, transport)
        out = await envoy.send("/v1/chat/completions", {**CHAT, "max_tokens": 2},
                               mode=mode, headers=CLIENT)  # fmt: skip
        assert out.status == 200
        (span,) = await ended(exporter, 1)
        await envoy.aclose()
    assert span.name == "POST /v1/chat/completions" and span.kind is SpanKind.SERVER
    ctx = span.get_span_context()
    assert ctx is not None and span.parent is not None
    assert f"{ctx.trace_id:032x}" == CLIENT_TRACE  # the client's trace
    assert f"{span.parent.span_id:016x}" == CLIENT_SPAN  # under the client's span
    attrs = dict(span.attributes or {})
    assert attrs["kvgate.engine"] == "http://" + out.destination  # the engine Envoy was sent to
    assert attrs["kvgate.outcome"] == "ok" and attrs["http.response.status_code"] == 200
    assert attrs["kvgate.route"] == "chat" and attrs["gen_ai.request.model"] == MODEL
    assert attrs["kvgate.policy"] and "kvgate.expected_hit_tokens" in attrs
    assert span.status.status_code is StatusCode.UNSET
    # the request Envoy forwards: the client's trace, the picker's span as the parent
    _, trace_id, parent_id, _ = out.set_headers["traceparent"].split("-")
    assert (trace_id, parent_id) == (CLIENT_TRACE, f"{ctx.span_id:016x}")
    assert out.set_headers["tracestate"] == CLIENT["tracestate"]


async def test_a_refused_request_is_a_span_with_its_status() -> None:
    async with traced_picker("both") as (server, transport, urls, exporter):
        envoy = FakeEnvoy(server, transport)
        transport.down.add(urls[0].removeprefix("http://"))
        # out of routing now (a refused connection), not after the health loop's next round
        server.service.registry.mark_failure(
            urls[0], "connection refused", server.service.clock(), immediate=True
        )
        out = await envoy.send("/v1/completions", {"model": MODEL, "prompt": "hi"}, headers=CLIENT)
        assert out.immediate_status == 503
        (span,) = await ended(exporter, 1)
        await envoy.aclose()
    assert dict(span.attributes or {})["http.response.status_code"] == 503
    assert span.status.status_code is StatusCode.ERROR


async def test_with_tracing_off_the_picker_sets_no_trace_header() -> None:
    async with (
        fleet("both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls]) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        out = await envoy.send("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                               headers=CLIENT)  # fmt: skip
        await envoy.aclose()
    assert out.status == 200
    assert "traceparent" not in out.set_headers  # Envoy forwards the client's own, unchanged
    assert server.tracing is None
