"""A tiny OTLP trace collector for tests: OTLP/gRPC ``TraceService.Export`` on 127.0.0.1.

It keeps every span it receives (at most ``limit``; later ones are counted and dropped)
with its resource's ``service.name``, and lets a test wait until the spans it expects
have arrived. vLLM exports over gRPC by default (``--otlp-traces-endpoint``), kvgate with
``tracing.protocol: grpc``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class CollectedSpan:
    service: str
    name: str
    trace_id: int
    span_id: int
    parent_span_id: int | None
    kind: int
    attributes: dict[str, Any]


def _value(v: Any) -> Any:
    field = v.WhichOneof("value")
    return getattr(v, field) if field else None


class OtlpCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """Listens on ``ports`` (one server, several ports: one per exporter if wanted)."""

    def __init__(self, ports: Iterable[int], limit: int = 20_000) -> None:
        self.limit = limit
        self.dropped = 0
        self._spans: list[CollectedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.ports = list(ports)
        for port in self.ports:
            self._server.add_insecure_port(f"127.0.0.1:{port}")
        self._server.start()

    def Export(  # noqa: N802 - the gRPC method's name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []

        def parent(raw: bytes) -> int | None:
            return int.from_bytes(raw, "big") if raw else None

        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(resource.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        CollectedSpan(
                            service=service,
                            name=s.name,
                            trace_id=int.from_bytes(s.trace_id, "big"),
                            span_id=int.from_bytes(s.span_id, "big"),
                            parent_span_id=parent(s.parent_span_id),
                            kind=s.kind,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self._lock:
            room = max(0, self.limit - len(self._spans))
            self._spans.extend(got[:room])
            self.dropped += len(got) - min(room, len(got))
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, trace_id: int | None = None) -> list[CollectedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(
        self, done: Callable[[list[CollectedSpan]], bool], trace_id: int, timeout: float
    ) -> list[CollectedSpan]:
        """The spans of ``trace_id`` once ``done`` holds for them; AssertionError past
        ``timeout`` (exporters send in batches, every 0.2-5 s)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans(trace_id)
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted((s.service, s.name) for s in spans)
                raise AssertionError(f"spans of the trace after {timeout:.0f} s: {names}")
            time.sleep(0.1)

    def stop(self) -> None:
        self._server.stop(grace=0).wait()
