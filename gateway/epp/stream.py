"""One ext_proc stream (one HTTP request through Envoy), message by message.

Request side, by the body mode Envoy announces in the stream's first message
(``protocol_config``):

* no body (``end_of_stream`` on the headers): picked at once, the answer goes with the
  headers response;
* ``BUFFERED``: the headers are answered at once (unchanged); the whole body arrives in
  one message; the pick goes with the body response (headers may still change then);
* ``FULL_DUPLEX_STREAMED``: nothing is answered until the body's last chunk (or the
  request trailers); then the headers response carries the pick and the body goes back
  unchanged as streamed body mutations (in that mode Envoy forwards only what the
  processor returns). The chunks are kept as received, joined once for parsing.

The body is parsed once, by the proxy's own :func:`~gateway.proxy.intake.build_exchange`
(same validation, model resolution, routing keys, sessions and pinned engines as
``kvgate serve``), after the client's key and rate limit (``api_keys``, ``rate_limit``).
kvgate's refusals are ``ImmediateResponse``s with the proxy's status and JSON body.

Response side: status and served endpoint from the response headers, the body chunks'
first bytes and usage tail, the end of the response (last chunk, trailers, or headers
alone) settle the request's ticket (:mod:`gateway.epp.accounting`); a stream that closes
first releases it. The end is settled *before* its answer is yielded: once Envoy has the
answer to the last chunk it ends the client's response and closes (or resets) the gRPC
stream, and grpc.aio may then drop the generator at that ``yield`` without resuming it;
code after the ``yield`` would not run and the request would be released as
``stream_closed`` (``cancelled``, usage lost) although the client got the whole answer.
Response chunks are answered one by one: unchanged (``STREAMED``) or sent back as
streamed mutations (``FULL_DUPLEX_STREAMED``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.proxy.endpoints import Endpoint, match
from gateway.proxy.errors import ApiError, anthropic_error_body, error_body
from gateway.proxy.exchange import Exchange
from gateway.proxy.fastpath import admit, client_credentials
from gateway.proxy.intake import build_exchange
from gateway.proxy.service import RoutingService

from . import protocol as p
from .accounting import Ledger, Ticket
from .picker import Picker
from .tracing import PickTracing

log = logging.getLogger("kvgate.epp")


@dataclass(slots=True)
class Verdict:
    """A complete request's answer, for either front end: routed (``destination`` and the
    header mutations) or refused (``status`` > 0: kvgate answers the client itself)."""

    set_headers: dict[str, str] = field(default_factory=dict)
    remove: list[str] = field(default_factory=list)
    destination: str = ""
    status: int = 0
    body: bytes = b""
    """The refusal's JSON body."""


def refusal(exc: ApiError, endpoint: Endpoint | None) -> Verdict:
    """kvgate's refusal of a request, in the endpoint's error shape (OpenAI's by default)."""
    if endpoint is not None and endpoint.errors == "anthropic":
        body = anthropic_error_body(exc.status, exc.message)
    else:
        body = error_body(exc.status, exc.message, param=exc.param, error_type=exc.error_type)
    headers = {"content-type": "application/json", **(exc.headers or {})}
    return Verdict(set_headers=headers, status=exc.status, body=json.dumps(body).encode())


def to_messages(verdict: Verdict, phase: str) -> list[Any]:
    """The verdict as ext_proc messages (the Python front end's)."""
    if verdict.status:
        return [p.immediate_bytes(verdict.status, verdict.body, verdict.set_headers)]
    return [
        p.routed(
            phase,
            p.mutation(verdict.set_headers, verdict.remove),
            p.destination_metadata(verdict.destination),
        )
    ]


def _client(headers: Mapping[str, str]) -> tuple[str, int] | None:
    forwarded = headers.get("x-forwarded-for") or headers.get("x-envoy-external-address")
    return (forwarded.split(",")[0].strip(), 0) if forwarded else None


class StreamHandler:
    """Turns one stream's ProcessingRequests into ProcessingResponses."""

    def __init__(
        self,
        service: RoutingService,
        picker: Picker,
        ledger: Ledger,
        *,
        tracing: PickTracing | None = None,
    ) -> None:
        self.service = service
        self.picker = picker
        self.ledger = ledger
        self.tracing = tracing
        """Spans per routed request (:mod:`gateway.epp.tracing`); None: tracing off."""

    async def run(self, requests: AsyncIterator[Any], context: Any = None) -> AsyncIterator[Any]:
        """``ExternalProcessor.Process``: one stream's answers, in order."""
        ticket: Ticket | None = None
        headers: dict[str, str] = {}
        subset: frozenset[str] | None = None
        chunks: list[bytes] = []
        size = 0
        limit = self.service.settings.max_body_bytes
        duplex = duplex_response = False
        first = True
        decided = False
        try:
            async for msg in requests:
                kind = msg.WhichOneof("request")
                if first:
                    duplex, duplex_response = p.request_streams(msg)
                    first = False
                if kind == "request_headers":
                    headers = p.headers_of(msg.request_headers)
                    subset = p.subset_hint(msg.metadata_context)
                    if msg.request_headers.end_of_stream:
                        answers, ticket = await self.decide(headers, [], subset, "request_headers")
                        decided = True
                        for answer in answers:
                            yield answer
                    elif not duplex:
                        yield p.REQUEST_HEADERS_CONTINUE
                elif kind == "request_body":
                    body = msg.request_body
                    if body.body:
                        chunks.append(body.body)
                        size += len(body.body)
                        if size > limit:
                            yield to_messages(self.too_large(), "")[0]
                            return
                    if body.end_of_stream and not decided:
                        phase = "request_headers" if duplex else "request_body"
                        echo = "end" if duplex else ""
                        answers, ticket = await self.decide(headers, chunks, subset, phase, echo)
                        decided = True
                        chunks = []
                        for answer in answers:
                            yield answer
                    elif not duplex:
                        yield p.REQUEST_BODY_CONTINUE
                elif kind == "request_trailers":
                    if not decided:  # a duplex body ended by its trailers
                        phase = "request_headers" if duplex else "request_body"
                        echo = "open" if duplex else ""
                        answers, ticket = await self.decide(headers, chunks, subset, phase, echo)
                        decided = True
                        chunks = []
                        for answer in answers:
                            yield answer
                    yield p.REQUEST_TRAILERS_CONTINUE
                elif kind == "response_headers":
                    if ticket is not None:
                        self.ledger.served(ticket, p.served_endpoint(msg.metadata_context))
                        status = p.headers_of(msg.response_headers).get(":status", "0")
                        self.ledger.response_headers(ticket, int(status) if status.isdigit() else 0)
                        if msg.response_headers.end_of_stream:  # settled before answering
                            self.ledger.finished(ticket)
                    yield p.RESPONSE_HEADERS_CONTINUE
                elif kind == "response_body":
                    body = msg.response_body
                    if ticket is not None:
                        self.ledger.response_bytes(ticket, body.body)
                        if body.end_of_stream:  # settled before answering: see the module doc
                            self.ledger.finished(ticket)
                    if duplex_response:
                        yield p.streamed_chunk(body.body, body.end_of_stream, response=True)
                    else:
                        yield p.RESPONSE_BODY_CONTINUE
                elif kind == "response_trailers":
                    if ticket is not None:
                        self.ledger.finished(ticket)
                    yield p.RESPONSE_TRAILERS_CONTINUE
        finally:
            if ticket is not None and not ticket.done:
                self.ledger.release(ticket, "stream_closed")

    async def decide(
        self,
        headers: dict[str, str],
        chunks: list[bytes],
        subset: frozenset[str] | None,
        phase: str,
        echo: str = "",
    ) -> tuple[list[Any], Ticket | None]:
        """The answers to a complete request (its pick, or kvgate's refusal) and its ticket.
        ``echo``: send the body back after the pick (FULL_DUPLEX_STREAMED), ending the body
        (``"end"``) or leaving it to the trailers (``"open"``)."""
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        verdict, ticket = await self.verdict(headers, raw, subset)
        out = to_messages(verdict, phase)
        return (out + self._echo(chunks, echo) if not verdict.status else out), ticket

    def too_large(self) -> Verdict:
        limit = self.service.settings.max_body_bytes
        return refusal(ApiError(413, f"request body is larger than {limit} bytes"), None)

    async def verdict(
        self, headers: dict[str, str], raw: bytes, subset: frozenset[str] | None
    ) -> tuple[Verdict, Ticket | None]:
        """Route one complete request (headers, body, the proxy's subset hint): the verdict,
        and the ticket that tracks it until its response ends (None: nothing to track)."""
        s = self.service
        started = s.clock()
        method = headers.get(":method", "GET")
        path = headers.get(":path", "/").split("?", 1)[0]
        found = match(method, path)
        if found is None:  # not an inference endpoint (/v1/models, /health): any engine
            return self._passthrough(subset), None
        endpoint, response_id = found
        ex: Exchange | None = None
        trace = self.tracing.begin(headers, method, endpoint.path, path) if self.tracing else None
        try:
            admit(s, endpoint.route, client_credentials(headers), _client(headers))  # type: ignore[arg-type]
            ex = await build_exchange(s, endpoint, headers, raw, started, response_id=response_id)
            if trace is not None:
                ex.trace = trace
                trace.request(ex)
            pick = await self.picker.pick(ex, subset)
        except ApiError as exc:
            if ex is not None and s.recorder is not None:
                s.recorder.record(ex, ok=False, outcome=f"rejected_{exc.status}", output=None)
            if trace is not None:
                trace.close(exc.status)
            return refusal(exc, endpoint), None
        except BaseException:  # the stream closed while the request waited, or a defect
            if trace is not None:
                trace.close(None)
            raise
        ticket = self.ledger.opened(ex, pick)
        ex.raw, ex.body = b"", None  # the ticket lives until the response ends: not the body
        set_headers = {p.DESTINATION: pick.destination, p.REQUEST_ID: ex.request_id}
        if trace is not None:  # the engine's spans become children of the picker's
            trace.decided(s.policy_name, pick.reason, pick.engine.id, pick.hit_tokens, ex.pd_reason)
            set_headers.update(trace.headers({}))
        remove: list[str] = []
        if pick.prefill is not None:
            set_headers[p.PREFILLER] = pick.prefill_address
        else:  # never the client's: it would make the sidecar prefill where it says
            remove.append(p.PREFILLER)
        if pick.engine.api_key:  # the engine's own key, as the proxy sends it
            set_headers["authorization"] = "Bearer " + pick.engine.api_key
            remove.append("x-api-key")
        elif s.settings.api_keys:  # a kvgate client key is kvgate's, not the engine's
            remove += ["authorization", "x-api-key"]
        return Verdict(set_headers, remove, pick.destination), ticket

    @staticmethod
    def _echo(chunks: list[bytes], echo: str) -> list[Any]:
        if not echo:
            return []
        return p.streamed_bodies(chunks or [b""], end=echo == "end")

    def _passthrough(self, subset: frozenset[str] | None) -> Verdict:
        engines = [
            e
            for e in self.service.registry.all()
            if e.routable and (subset is None or self.picker.address(e) in subset)
        ]
        if not engines:
            exc = ApiError(503, "no healthy engine is available", headers={"Retry-After": "1"})
            return refusal(exc, None)
        flying = self.service.dispatcher.in_flight
        engine = min(engines, key=lambda e: flying.get(e.id, 0))
        address = self.picker.address(engine)
        return Verdict({p.DESTINATION: address}, [p.PREFILLER], address)
