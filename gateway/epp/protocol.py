"""The Endpoint Picker protocol's messages: reading Envoy's, building the answers.

Names and namespaces are the Gateway API Inference Extension's (proposal 004, v1.0):

* request: the subset hint in ``metadata_context.filter_metadata["envoy.lb.subset_hint"]
  ["x-gateway-destination-endpoint-subset"]`` (a list of ``ip:port``);
* answer: header ``x-gateway-destination-endpoint`` and dynamic metadata
  ``{"envoy.lb": {"x-gateway-destination-endpoint": ...}}``, the same value in both
  (``ip:port``, or ``ip:port,ip:port,...``: the primary, then fallbacks in order);
* response: the endpoint that served it in ``metadata_context.filter_metadata["envoy.lb"]
  ["x-gateway-destination-endpoint-served"]``.

Constant answers are built once; a body is never copied here beyond protobuf's own copy
into the message.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
LB_NAMESPACE = "envoy.lb"
PREFILLER = "x-prefiller-host-port"
"""llm-d's routing sidecar convention: the decode engine's sidecar runs the prefill leg on
the engine this header names (``host:port``) before decoding locally."""
REQUEST_ID = "x-request-id"

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
_OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
STREAM_CHUNK_BYTES = 1 << 20
"""A body sent back in FULL_DUPLEX_STREAMED mode goes in messages of at most 1 MiB."""

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse


def headers_of(message: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's headers as a dict of lowercase names (pseudo-headers included: ``:path``)."""
    out: dict[str, str] = {}
    for h in message.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def _namespace(metadata: base_pb2.Metadata, name: str) -> struct_pb2.Struct | None:
    filters = metadata.filter_metadata
    return filters.get(name, None)


def subset_hint(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """The endpoints the proxy allows for this request, or None when it sent no hint."""
    ns = _namespace(metadata, SUBSET_NAMESPACE)
    if ns is None or SUBSET not in ns.fields:
        return None
    value = ns.fields[SUBSET]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    if value.HasField("string_value"):  # tolerate "a,b" as one string
        return frozenset(s.strip() for s in value.string_value.split(",") if s.strip())
    return frozenset()


def served_endpoint(metadata: base_pb2.Metadata) -> str | None:
    """The endpoint Envoy says served the request (``ip:port``), if it said."""
    ns = _namespace(metadata, LB_NAMESPACE)
    if ns is None or SERVED not in ns.fields:
        return None
    return ns.fields[SERVED].string_value.split(",")[0].strip() or None


def request_streams(message: pb.ProcessingRequest) -> tuple[bool, bool]:
    """(request body, response body) in FULL_DUPLEX_STREAMED mode, from the stream's first
    message (``protocol_config``; absent from older Envoys: buffered then)."""
    if not message.HasField("protocol_config"):
        return False, False
    config = message.protocol_config
    return config.request_body_mode == FULL_DUPLEX, config.response_body_mode == FULL_DUPLEX


def _option(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode("latin-1")),
        append_action=_OVERWRITE,
    )


def mutation(set_headers: Mapping[str, str], remove: Iterable[str] = ()) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[_option(k, v) for k, v in set_headers.items()], remove_headers=list(remove)
    )


def destination_metadata(value: str) -> struct_pb2.Struct:
    """``{"envoy.lb": {"x-gateway-destination-endpoint": value}}``."""
    inner = struct_pb2.Struct()
    inner.fields[DESTINATION].string_value = value
    outer = struct_pb2.Struct()
    outer.fields[LB_NAMESPACE].struct_value.CopyFrom(inner)
    return outer


def routed(
    phase: str, headers: pb.HeaderMutation, metadata: struct_pb2.Struct
) -> pb.ProcessingResponse:
    """The pick, answered to the request's headers (``phase="request_headers"``) or, when the
    body was buffered, to its body (``"request_body"``)."""
    common = pb.CommonResponse(header_mutation=headers, clear_route_cache=True)
    if phase == "request_headers":
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
        )
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
    )


def streamed_chunk(data: bytes, end: bool, *, response: bool = False) -> pb.ProcessingResponse:
    """One chunk of a FULL_DUPLEX_STREAMED body, sent back unchanged (Envoy forwards only
    what the processor returns in that mode)."""
    body = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=data, end_of_stream=end))
    answer = pb.BodyResponse(response=pb.CommonResponse(body_mutation=body))
    if response:
        return pb.ProcessingResponse(response_body=answer)
    return pb.ProcessingResponse(request_body=answer)


def streamed_bodies(chunks: list[bytes], *, end: bool = True) -> list[pb.ProcessingResponse]:
    """A held request body sent back: the received chunks, merged into messages of up to
    ``STREAM_CHUNK_BYTES``; the last one ends the body when ``end`` (else trailers do)."""
    out: list[pb.ProcessingResponse] = []
    batch: list[bytes] = []
    size = 0
    for chunk in chunks:
        if batch and size + len(chunk) > STREAM_CHUNK_BYTES:
            out.append(streamed_chunk(b"".join(batch), False))
            batch, size = [], 0
        batch.append(chunk)
        size += len(chunk)
    out.append(streamed_chunk(batch[0] if len(batch) == 1 else b"".join(batch), end))
    return out


def immediate(status: int, body: Any, headers: Mapping[str, str] | None = None) -> Any:
    """An ``ImmediateResponse``: kvgate answers the client itself (JSON ``body``)."""
    hdrs = {"content-type": "application/json", **(headers or {})}
    return immediate_bytes(status, json.dumps(body).encode(), hdrs)


def immediate_bytes(status: int, body: bytes, headers: Mapping[str, str]) -> Any:
    """An ``ImmediateResponse`` with this body and these headers, as given."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=mutation(headers),
            body=body,
            details=f"kvgate_epp_{status}",
        )
    )


REQUEST_HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
REQUEST_BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse())
REQUEST_TRAILERS_CONTINUE = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
RESPONSE_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
RESPONSE_BODY_CONTINUE = pb.ProcessingResponse(response_body=pb.BodyResponse())
RESPONSE_TRAILERS_CONTINUE = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
"""Answers that change nothing (shared, never mutated)."""
