"""Trace context through the gateway (in process, fake engines that record their headers).

Off (the default): the client's ``traceparent``, ``tracestate`` and ``baggage`` reach every
engine call unchanged, both P/D legs included. On, with the SDK's in-memory exporter: one
trace from the client's span through kvgate's server span to one child span per upstream
call, each of which is the parent the engine receives in its ``traceparent``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config import load_settings
from gateway.proxy.app import create_app
from tests.proxy.fake_engines import FakeCluster, FakeEngine
from tests.proxy.hostile_engine import MODEL as HOSTILE_MODEL
from tests.proxy.hostile_engine import HostileEngine

P0, D0, E0, E1 = "http://p0:8000", "http://d0:8000", "http://e0:8000", "http://e1:8000"
LONG = "a long prompt that is worth a remote prefill " * 60  # ~700 tokens, cold
CLIENT = {
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "tracestate": "vendor=opaque-value",
    "baggage": "tenant=acme,run=42",
}


@asynccontextmanager
async def gateway(
    *engines: tuple[FakeEngine, str], provider: TracerProvider | None = None, **settings: Any
) -> AsyncIterator[httpx.AsyncClient]:
    cluster = FakeCluster(*(e for e, _ in engines))
    cfg = load_settings(
        engines=[{"url": e.url, "role": role} for e, role in engines],
        retries={"max_attempts": 3, "backoff_s": 0.0},
        tracing={"enabled": provider is not None},
        **settings,
    )
    app = create_app(cfg, transport=cluster.transport(), tracer_provider=provider)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client


def traced() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def parent_in(headers: dict[str, str]) -> tuple[int, int]:
    """(trace id, parent span id) of a request's ``traceparent``."""
    _, trace_id, span_id, _ = headers["traceparent"].split("-")
    return int(trace_id, 16), int(span_id, 16)


def run_fresh(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter at the repository's root (exit status 0 asserted)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


# -- tracing off: the client's trace context is forwarded unchanged ---------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_trace_headers_reach_both_pd_legs_unchanged_with_tracing_off(stream: bool) -> None:
    p, d = FakeEngine(P0), FakeEngine(D0)
    async with gateway((p, "prefill"), (d, "decode")) as gw:
        body = {"model": "m", "prompt": LONG, "stream": stream}
        r = await gw.post("/v1/completions", json=body, headers=CLIENT)
    assert r.status_code == 200
    assert len(p.headers) == len(d.headers) == 1  # a remote prefill leg, then the decode leg
    for got in (p.headers[0], d.headers[0]):
        assert {k: got.get(k) for k in CLIENT} == CLIENT


async def test_trace_headers_reach_a_unified_engine_and_other_headers_do_not() -> None:
    e = FakeEngine(E0)
    async with gateway((e, "both")) as gw:
        body = {"model": "m", "prompt": "hi"}
        r = await gw.post("/v1/completions", json=body, headers={**CLIENT, "x-secret": "no"})
    assert r.status_code == 200
    (got,) = e.headers
    assert {k: got.get(k) for k in CLIENT} == CLIENT
    assert "x-secret" not in got


@pytest.mark.parametrize("tracing", [False, True])
async def test_trace_headers_reach_the_engine_through_kvgates_own_http_client(
    tracing: bool,
) -> None:
    """Over a real socket (kvgate's HTTP/1.1 client, no mock transport): off, the client's
    headers arrive as sent; on, ``traceparent`` names kvgate's attempt span instead."""
    provider, exporter = traced()
    async with HostileEngine() as engine:
        cfg = load_settings(
            engines=[{"url": engine.url, "model": HOSTILE_MODEL}], tracing={"enabled": tracing}
        )
        app = create_app(cfg, tracer_provider=provider)  # no transport: the real HttpUpstream
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as gw:
                body = {"model": HOSTILE_MODEL, "prompt": "hi"}
                r = await gw.post("/v1/completions", json=body, headers=CLIENT)
    assert r.status_code == 200, r.text
    (head,) = [h for h in engine.heads if h.startswith(b"POST /v1/completions ")]
    lines = head.decode("latin-1").split("\r\n")[1:]
    got = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln)}
    assert got["tracestate"] == CLIENT["tracestate"] and got["baggage"] == CLIENT["baggage"]
    if not tracing:
        assert got["traceparent"] == CLIENT["traceparent"]
        assert not exporter.get_finished_spans()
        return
    (attempt,) = by_name(exporter.get_finished_spans(), "kvgate.attempt")
    assert parent_in(got) == (int(CLIENT["traceparent"].split("-")[1], 16), attempt.context.span_id)


async def test_tracing_off_creates_no_trace_and_imports_no_opentelemetry() -> None:
    """The gateway serves a request with tracing off without loading kvgate's tracing
    module or the OpenTelemetry SDK (a fresh interpreter: this one has the SDK loaded for
    the other tests). FastAPI itself imports the OpenTelemetry API, not kvgate."""
    code = """
import asyncio, sys, httpx
from gateway.config import load_settings
from gateway.proxy.app import create_app
from tests.proxy.fake_engines import FakeCluster, FakeEngine
from tests.proxy.hostile_engine import MODEL as HOSTILE_MODEL
from tests.proxy.hostile_engine import HostileEngine

async def main():
    e = FakeEngine("http://e0:8000")
    app = create_app(load_settings(engines=[{"url": e.url}]),
                     transport=FakeCluster(e).transport())
    async with app.router.lifespan_context(app):
        t = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=t, base_url="http://gw") as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi"},
                             headers={"traceparent": "00-%s-%s-01" % ("1" * 32, "2" * 16)})
    assert r.status_code == 200, r.text
    assert e.headers[0]["traceparent"] == "00-%s-%s-01" % ("1" * 32, "2" * 16)
    loaded = sorted(m for m in sys.modules if m.startswith(
        ("opentelemetry.sdk", "opentelemetry.exporter", "gateway.tracing.otel")))
    print("LOADED", loaded)

asyncio.run(main())
"""
    out = run_fresh(code)
    assert "LOADED []" in out.stdout, out.stdout


def test_fastapis_own_telemetry_is_off_even_with_a_global_tracer_provider() -> None:
    """FastAPI 0.165+ traces every request itself once a global tracer provider is set (an
    ``opentelemetry-instrument`` launch does that); kvgate's spans are its own, so the gateway
    app turns FastAPI's off: a request makes no span (a fresh interpreter: the global provider
    cannot be unset)."""
    code = """
import asyncio, httpx
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from gateway.config import load_settings
from gateway.proxy.app import create_app
from tests.proxy.fake_engines import FakeCluster, FakeEngine

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)

async def main():
    e = FakeEngine("http://e0:8000")
    app = create_app(load_settings(engines=[{"url": e.url}]),
                     transport=FakeCluster(e).transport())
    async with app.router.lifespan_context(app):
        t = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=t, base_url="http://gw") as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 200, r.text
    print("SPANS", [s.name for s in exporter.get_finished_spans()])

asyncio.run(main())
"""
    out = run_fresh(code)
    assert "SPANS []" in out.stdout, out.stdout


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_otlp_exporter_of_each_protocol_is_built(protocol: str) -> None:
    """What ``kvgate serve`` builds with tracing on: the SDK, its batch processor and the OTLP
    exporter import and start (a package overwriting opentelemetry-proto's modules, as
    xds-protos does, fails here with the fix in its message)."""
    from gateway.tracing.config import TracingConfig
    from gateway.tracing.otel import build_provider

    provider = build_provider(TracingConfig(enabled=True, protocol=protocol, endpoint=None))
    assert provider.get_tracer("t").start_span("s").get_span_context().is_valid
    provider.shutdown()  # type: ignore[attr-defined]


# -- tracing on: one trace through every hop ---------------------------------------------------
async def test_one_trace_from_the_client_through_kvgate_to_the_engine() -> None:
    provider, exporter = traced()
    client_span = provider.get_tracer("client").start_span("client call", kind=SpanKind.CLIENT)
    headers: dict[str, str] = {"baggage": "tenant=acme"}
    TraceContextTextMapPropagator().inject(headers, context=set_span_in_context(client_span))
    e = FakeEngine(E0)
    async with gateway((e, "both"), provider=provider) as gw:
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": LONG}, headers=headers)
        assert (await gw.get("/metrics")).status_code == 200  # not a proxied route: no span
    client_span.end()
    assert r.status_code == 200
    spans = exporter.get_finished_spans()
    (server,) = by_name(spans, "POST /v1/completions")
    (attempt,) = by_name(spans, "kvgate.attempt")
    assert len(spans) == 3  # client, server, attempt: /metrics made none
    trace_id = client_span.get_span_context().trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}
    assert server.kind is SpanKind.SERVER and attempt.kind is SpanKind.CLIENT
    assert server.parent is not None and server.parent.span_id == client_span.context.span_id
    assert attempt.parent is not None and attempt.parent.span_id == server.context.span_id
    (got,) = e.headers
    assert parent_in(got) == (trace_id, attempt.context.span_id)  # the engine's parent
    assert got["baggage"] == "tenant=acme"
    attrs = dict(server.attributes or {})
    assert attrs["kvgate.policy"] == "predicted_ttft"  # the default policy
    assert attrs["kvgate.engine"] == E0 and attrs["kvgate.route"] == "completions"
    assert attrs["gen_ai.request.model"] == "m" and attrs["http.response.status_code"] == 200
    assert attrs["kvgate.decision.reason"] and attrs["kvgate.expected_hit_tokens"] == 0
    assert attrs["kvgate.retries"] == 0 and attrs["kvgate.pd.mode"] == "unified"
    assert attrs["kvgate.outcome"] == "ok"
    assert 0 <= attrs["kvgate.queue_wait_s"] < 1  # flow control admitted it at once
    assert attempt.status.status_code is not StatusCode.ERROR


async def test_a_request_without_traceparent_starts_a_trace_the_engine_joins() -> None:
    provider, exporter = traced()
    e = FakeEngine(E0)
    async with gateway((e, "both"), provider=provider) as gw:
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})
    assert r.status_code == 200 and "[DONE]" in r.text
    spans = exporter.get_finished_spans()
    (server,) = by_name(spans, "POST /v1/completions")
    (attempt,) = by_name(spans, "kvgate.attempt")
    assert server.parent is None  # a new trace
    assert parent_in(e.headers[0]) == (server.context.trace_id, attempt.context.span_id)
    assert attempt.end_time is not None and server.end_time is not None
    assert attempt.end_time <= server.end_time  # the stream ended before the request did


async def test_pd_legs_are_two_children_each_the_parent_of_its_engine_call() -> None:
    provider, exporter = traced()
    p, d = FakeEngine(P0), FakeEngine(D0)
    async with gateway((p, "prefill"), (d, "decode"), provider=provider) as gw:
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": LONG}, headers=CLIENT)
    assert r.status_code == 200
    spans = exporter.get_finished_spans()
    (server,) = by_name(spans, "POST /v1/completions")
    (prefill,) = by_name(spans, "kvgate.prefill")
    (decode,) = by_name(spans, "kvgate.decode")
    trace_id = int(CLIENT["traceparent"].split("-")[1], 16)
    assert server.context.trace_id == trace_id
    assert server.parent is not None and server.parent.span_id == int("b7ad6b7169203331", 16)
    for leg, engine, url in ((prefill, p, P0), (decode, d, D0)):
        assert leg.parent is not None and leg.parent.span_id == server.context.span_id
        assert dict(leg.attributes or {})["kvgate.engine"] == url
        assert parent_in(engine.headers[0]) == (trace_id, leg.context.span_id)
        assert engine.headers[0]["tracestate"] == CLIENT["tracestate"]
        assert engine.headers[0]["baggage"] == CLIENT["baggage"]
    assert prefill.end_time is not None and decode.start_time is not None
    assert prefill.end_time <= decode.start_time  # the prefill leg ran first
    attrs = dict(server.attributes or {})
    assert attrs["kvgate.pd.mode"] == "remote_uncached"
    assert attrs["kvgate.pd.prefill_engine"] == P0


async def test_a_failed_prefill_leg_is_an_error_span_before_the_local_decode_leg() -> None:
    provider, exporter = traced()
    p, d = FakeEngine(P0, mode="status503"), FakeEngine(D0)
    async with gateway((p, "prefill"), (d, "decode"), provider=provider) as gw:
        body = {"model": "m", "prompt": LONG, "stream": True}
        r = await gw.post("/v1/completions", json=body, headers=CLIENT)
    assert r.status_code == 200 and "[DONE]" in r.text
    spans = exporter.get_finished_spans()
    (server,) = by_name(spans, "POST /v1/completions")
    (prefill,) = by_name(spans, "kvgate.prefill")
    (decode,) = by_name(spans, "kvgate.decode")
    assert prefill.status.status_code is StatusCode.ERROR
    assert dict(prefill.attributes or {})["error.type"] == "prefill_failed"
    assert decode.status.status_code is not StatusCode.ERROR
    assert parent_in(p.headers[0])[1] == prefill.context.span_id
    assert parent_in(d.headers[0])[1] == decode.context.span_id
    attrs = dict(server.attributes or {})
    assert attrs["kvgate.pd.prefill_engine"] == "local" and attrs["kvgate.outcome"] == "ok"


async def test_a_retry_makes_a_second_attempt_span_and_a_new_parent_for_the_engine() -> None:
    provider, exporter = traced()
    bad, good = FakeEngine(E0, mode="status503"), FakeEngine(E1)
    async with gateway((bad, "both"), (good, "both"), provider=provider) as gw:
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": LONG}, headers=CLIENT)
    assert r.status_code == 200
    spans = exporter.get_finished_spans()
    (server,) = by_name(spans, "POST /v1/completions")
    first, second = sorted(by_name(spans, "kvgate.attempt"), key=lambda s: s.start_time or 0)
    assert dict(first.attributes or {})["kvgate.engine"] == E0
    assert first.status.status_code is StatusCode.ERROR
    assert dict(first.attributes or {})["error.type"] == "status_503"
    assert dict(second.attributes or {})["kvgate.engine"] == E1
    assert second.status.status_code is not StatusCode.ERROR
    assert {a.parent.span_id for a in (first, second) if a.parent} == {server.context.span_id}
    assert parent_in(bad.headers[0])[1] == first.context.span_id
    assert parent_in(good.headers[0])[1] == second.context.span_id
    attrs = dict(server.attributes or {})
    assert attrs["kvgate.retries"] == 1 and attrs["kvgate.attempts"] == 2


async def test_a_refused_request_has_a_server_span_marked_as_an_error() -> None:
    provider, exporter = traced()
    async with gateway((FakeEngine(E0, mode="refuse"), "both"), provider=provider) as gw:
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers=CLIENT)
    assert r.status_code == 503
    (server,) = by_name(exporter.get_finished_spans(), "POST /v1/completions")
    assert server.status.status_code is StatusCode.ERROR
    assert dict(server.attributes or {})["http.response.status_code"] == 503
