"""One trace through the client, kvgate and both P/D legs on real vLLM.

The fleet's NIXL prefill and decode engines export their spans
(``--otlp-traces-endpoint``) to an OTLP/gRPC collector this test runs; kvgate, with
``tracing.enabled``, exports to the same collector. One request with the client's
``traceparent`` must leave, under the client's trace id: kvgate's server span (child of the
client span), its ``kvgate.prefill`` and ``kvgate.decode`` spans (children of the server
span), and vLLM's ``llm_request`` span on each engine, each a child of the kvgate span that
called that engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import MODEL, Fleet, listen_port, start_gateway
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from otlp_collector import CollectedSpan, OtlpCollector

pytestmark = pytest.mark.vllm
PROMPT = "a prompt long enough to be worth prefilling on its own engine " * 12


@pytest.fixture
def collector(fleet: Fleet) -> Iterator[OtlpCollector]:
    """On the ports the prefill and decode engines export to, and one for kvgate."""
    assert fleet.prefill.otlp_port and fleet.decode.otlp_port
    c = OtlpCollector([fleet.prefill.otlp_port, fleet.decode.otlp_port, listen_port()])
    try:
        yield c
    finally:
        c.stop()


def one(spans: list[CollectedSpan], service: str, name: str) -> CollectedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


def test_one_trace_id_spans_client_kvgate_and_both_pd_legs_on_real_vllm(
    fleet: Fleet, collector: OtlpCollector, tmp_path: Path
) -> None:
    gw = start_gateway(
        tmp_path,
        ["--policy", "round_robin", "--prefill", fleet.prefill.url, "--decode", fleet.decode.url],
        env={
            "KVGATE_PD__MIN_UNCACHED_TOKENS": "0",  # always disaggregate
            "KVGATE_TRACING__ENABLED": "true",
            "KVGATE_TRACING__ENDPOINT": f"http://127.0.0.1:{collector.ports[2]}",
            "KVGATE_TRACING__SCHEDULE_DELAY_S": "0.2",
        },
    )
    client_span = TracerProvider().get_tracer("client").start_span("client", kind=SpanKind.CLIENT)
    headers: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(headers, context=set_span_in_context(client_span))
    try:
        r = httpx.post(
            gw.url + "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
            headers=headers,
            timeout=120,
        )
    finally:
        client_span.end()
        gw.stop()  # flushes kvgate's spans
    assert r.status_code == 200, r.text
    trace_id = client_span.get_span_context().trace_id

    def complete(spans: list[CollectedSpan]) -> bool:
        names = [(s.service, s.name) for s in spans]
        return (
            ("vllm-prefill", "llm_request") in names
            and ("vllm-decode", "llm_request") in names
            and ("kvgate", "kvgate.decode") in names
        )

    spans = collector.wait_for(complete, trace_id, timeout=60)
    server = one(spans, "kvgate", "POST /v1/completions")
    prefill = one(spans, "kvgate", "kvgate.prefill")
    decode = one(spans, "kvgate", "kvgate.decode")
    on_prefill = one(spans, "vllm-prefill", "llm_request")
    on_decode = one(spans, "vllm-decode", "llm_request")
    assert server.parent_span_id == client_span.get_span_context().span_id
    assert prefill.parent_span_id == decode.parent_span_id == server.span_id
    assert on_prefill.parent_span_id == prefill.span_id  # vLLM continued kvgate's leg span
    assert on_decode.parent_span_id == decode.span_id
    assert server.attributes["kvgate.pd.prefill_engine"] == fleet.prefill.url
    assert on_prefill.attributes.get("gen_ai.usage.completion_tokens") == 1  # the prefill leg
    assert on_decode.attributes.get("gen_ai.usage.completion_tokens") == 4
