"""Each picked request's accounting, from the pick to the end of its response (:class:`Ledger`).

A pick opens a :class:`Ticket`: the dispatcher counts the request in flight on its engine
(and its prefill engine, in P/D), the registry counts its pending prompt tokens. Envoy's
response events settle it as the HTTP proxy settles a request: the first response bytes are
its first token (pending tokens cleared, the policy's ``on_first_token``, TTFT); the end of
the response finishes it (``Dispatcher.finished`` with the output length read from the
usage, the engine's breaker fed, metrics, the recorder, a stored response's id bound to its
engine). A 5xx counts against the engine. When Envoy served the request on a fallback
(``x-gateway-destination-endpoint-served``), the primary is finished as failed and the
serving engine gets the rest of the bookkeeping.

A ticket is settled exactly once: by its response's end, by its gRPC stream closing first
(Envoy cancelled the request or went away), or by the release timer
(``release_after_s``) when neither comes. Open tickets are bounded by the requests Envoy
has in flight.
"""

from __future__ import annotations

import asyncio
import logging
import re

from prometheus_client import Counter, Gauge

from gateway.proxy.exchange import Exchange
from gateway.proxy.relay import completion_tokens, stream_ended
from gateway.proxy.response_store import response_id_in
from gateway.proxy.service import RoutingService
from gateway.proxy.settle import Settler

from .picker import Pick, Picker

log = logging.getLogger("kvgate.epp")

_TAIL_BYTES = 4096
_HEAD_BYTES = 8192
_DATA = re.compile(rb"^data: ", re.M)


def _answered(ticket: Ticket) -> bool:
    """The streamed answer's last event is in the bytes seen (its final few hundred)."""
    end = ticket.tail[-512:]
    return ticket.ex.stream and stream_ended(end)


class Ticket:
    """One picked request whose response kvgate has not seen end yet."""

    __slots__ = (
        "done",
        "engine",
        "events",
        "ex",
        "first",
        "head",
        "pick",
        "primary",
        "status",
        "tail",
        "timer",
    )

    def __init__(self, ex: Exchange, pick: Pick) -> None:
        self.ex = ex
        self.pick = pick
        self.engine = pick.engine.id
        self.primary = True
        """The engine is the dispatcher's choice (False: Envoy retried on a fallback)."""
        self.status = 0
        self.first = False
        self.done = False
        self.head = b""
        self.tail = b""
        self.events = 0
        self.timer: asyncio.TimerHandle | None = None


class Ledger:
    """Opens and settles tickets; every path settles each one exactly once."""

    def __init__(self, service: RoutingService, picker: Picker, *, release_after_s: float) -> None:
        self.service = service
        self.picker = picker
        self.release_after_s = release_after_s
        self.settler = Settler(
            service.settings,
            service.registry,
            dispatcher=service.dispatcher,
            metrics=service.metrics,
            clock=service.clock,
            pump=service.release,
        )
        """The end of each request, settled as the HTTP proxy settles it."""
        self.open: dict[int, Ticket] = {}
        """Unsettled tickets by id (their number is Envoy's in-flight requests)."""
        reg = service.metrics.registry
        self.released = Counter(
            "kvgate_epp_released_total",
            "Picked requests settled without their response's end, by why",
            ["reason"],
            registry=reg,
        )
        Gauge(
            "kvgate_epp_open_requests",
            "Picked requests whose response has not ended",
            registry=reg,
        ).set_function(lambda: len(self.open))

    def opened(self, ex: Exchange, pick: Pick) -> Ticket:
        ticket = Ticket(ex, pick)
        if pick.prefill is not None:  # the sidecar's prefill leg: pending until first bytes
            reg = self.service.registry
            reg.add_pending(pick.prefill.id, ex.request_id + "#prefill", ex.info.prompt_tokens)
        self.open[id(ticket)] = ticket
        loop = asyncio.get_running_loop()
        ticket.timer = loop.call_later(self.release_after_s, self.release, ticket, "timeout")
        return ticket

    # -- response events ---------------------------------------------------------
    def served(self, ticket: Ticket, address: str | None) -> None:
        """Envoy says which endpoint served: a fallback means the primary failed."""
        if address is None or address == ticket.pick.address or not ticket.primary:
            return
        engine = self.picker.engine_at(address)
        if engine is None:
            return
        s = self.service
        now = s.clock()
        primary = ticket.engine
        s.registry.clear_pending(primary, ticket.ex.request_id)
        s.registry.end_attempt(primary, ticket.ex.request_id)
        s.dispatcher.finished(ticket.ex.info, primary, now, ok=False)
        s.metrics.engine_errors.labels(primary, "envoy_fallback").inc()
        s.registry.mark_failure(primary, f"Envoy served {ticket.ex.request_id} elsewhere", now)
        s.pump.pump(primary)
        ticket.primary = False
        ticket.engine = engine.id
        ticket.ex.engine = engine.id
        ticket.ex.attempts += 1
        s.registry.begin_attempt(engine.id, ticket.ex.request_id, lora=ticket.ex.info.lora)

    def response_headers(self, ticket: Ticket, status: int) -> None:
        ticket.status = status
        s = self.service
        if status >= 500:
            s.metrics.engine_errors.labels(ticket.engine, f"status_{status}").inc()
            s.registry.mark_failure(ticket.engine, f"engine answered {status}", s.clock())
        elif status == 404 and ticket.ex.endpoint.kind != "stored":
            s.monitor.refresh_models_soon(ticket.engine)

    def response_bytes(self, ticket: Ticket, chunk: bytes) -> None:
        """A response body chunk: the first one is the first token; keep the usage tail."""
        if not ticket.first:
            self._first_token(ticket)
        if ticket.ex.stream:
            ticket.events += len(_DATA.findall(chunk))
        if ticket.ex.store_response and len(ticket.head) < _HEAD_BYTES:
            ticket.head += chunk[: _HEAD_BYTES - len(ticket.head)]
            found = response_id_in(ticket.head)
            if found is not None and ticket.status == 200:
                ticket.ex.store_response = False
                self.service.responses.bind(found, ticket.engine)
        ticket.tail = (
            (ticket.tail + chunk)[-_TAIL_BYTES:]
            if len(chunk) < _TAIL_BYTES
            else (chunk[-_TAIL_BYTES:])
        )

    def _first_token(self, ticket: Ticket) -> None:
        ticket.first = True
        s = self.service
        now = s.clock()
        ex = ticket.ex
        s.registry.clear_pending(ticket.engine, ex.request_id)
        pick = ticket.pick
        if pick.prefill is not None:  # the sidecar's prefill leg is over
            s.registry.clear_pending(pick.prefill.id, ex.request_id + "#prefill")
            s.dispatcher.prefill_done(ex.info, pick.prefill.id, now, ok=ticket.status < 500)
        if ticket.status == 200:
            if ticket.primary:
                s.dispatcher.first_token(ex.info, ticket.engine, now)
            s.metrics.ttft.labels(ex.route).observe(now - ex.started)
        s.pump.pump(ticket.engine)

    def finished(self, ticket: Ticket) -> None:
        """The response ended (its last body chunk, its trailers, or headers alone)."""
        if ticket.done:
            return
        if not ticket.first:
            self._first_token(ticket)
        ok = 0 < ticket.status < 400
        output = completion_tokens(ticket.tail) if ok else None
        if output is None and ok and ticket.events:
            output = max(0, ticket.events - 2)  # minus the role chunk and [DONE]: an estimate
        ex = ticket.ex
        if ok and ex.method == "DELETE" and ex.response_id:
            self.service.responses.forget(ex.response_id)
        outcome = (
            "ok" if ok else ("engine_error" if ticket.status >= 500 else "engine_client_error")
        )
        self._settle(ticket, ok=ok, output=output, outcome=outcome)

    def release(self, ticket: Ticket, reason: str) -> None:
        """Settle a ticket whose response did not end: ``timeout`` or ``stream_closed``.

        A streamed answer whose last event went through (``data: [DONE]``, Messages'
        ``message_stop``, Responses' ``response.completed``) is finished, not cancelled: a
        client that stops reading at that event (the ``openai`` client does) closes its
        connection before Envoy sends the body's ``end_of_stream``, and Envoy then closes
        the stream; ``kvgate serve`` records that request as answered, with its usage."""
        if ticket.done:
            return
        if reason == "stream_closed" and ticket.status == 200 and _answered(ticket):
            self.finished(ticket)
            return
        self.released.labels(reason).inc()
        if ticket.pick.prefill is not None and not ticket.first:
            s = self.service
            s.registry.clear_pending(ticket.pick.prefill.id, ticket.ex.request_id + "#prefill")
            s.dispatcher.prefill_done(ticket.ex.info, ticket.pick.prefill.id, s.clock(), ok=False)
        log.info(
            "request released before its response ended",
            extra={"request_id": ticket.ex.request_id, "reason": reason, "engine": ticket.engine},
        )
        self._settle(ticket, ok=False, output=None, outcome="cancelled", released=True)

    def _settle(
        self, ticket: Ticket, *, ok: bool, output: int | None, outcome: str, released: bool = False
    ) -> None:
        ticket.done = True
        self.open.pop(id(ticket), None)
        if ticket.timer is not None:
            ticket.timer.cancel()
        ex = ticket.ex
        self.service.registry.clear_pending(ticket.engine, ex.request_id)
        self.settler.recorder = self.service.recorder
        self.settler.settle(
            ex,
            ticket.engine,
            ok=ok,
            output=output,
            outcome=outcome,
            usage=b"" if released else ticket.tail,
            finish_policy=ticket.primary,
        )
        if ex.trace is not None:  # the request's span ends with its accounting
            ex.trace.close(ticket.status or None)
