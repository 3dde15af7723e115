"""Pick the engine for one exchange, as the HTTP proxy's first attempt would (:class:`Picker`).

The view is the proxy's (engines serving the model; only the pinned engine of a stored
response; prefill-only engines only for endpoints that run disaggregated), narrowed to the
proxy's subset hint when it sent one. The dispatcher decides (the same policy object, router
queues and hooks as ``kvgate serve``); a held request waits in its router queue until the
pump releases it (``queue_timeout_s``, then 503). The answer names the engine's
``host:port``, then up to ``fallbacks`` other eligible engines, least loaded first, which
Envoy tries in order when it retries; in a disaggregated pool it also names the prefill
engine (llm-d's ``x-prefiller-host-port`` convention).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.cluster.registry import EngineState
from gateway.core.types import ClusterView, Decision, EngineRole
from gateway.proxy.decide import Decider
from gateway.proxy.errors import ApiError
from gateway.proxy.exchange import Exchange
from gateway.proxy.service import RoutingService


def address_of(url: str) -> str:
    """An engine URL's ``host:port`` (the port implied by the scheme when absent)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(slots=True)
class Pick:
    """Where one request goes: its engine, fallbacks, and prefill engine (P/D)."""

    engine: EngineState
    address: str
    fallbacks: tuple[str, ...] = ()
    prefill: EngineState | None = None
    prefill_address: str = ""
    hit_tokens: int = 0
    reason: str | None = None
    """The policy's reason for the pick (as in ``kvgate_routing_decisions_total``)."""

    @property
    def destination(self) -> str:
        """The protocol's value: primary, then fallbacks, comma-separated."""
        return ",".join((self.address, *self.fallbacks)) if self.fallbacks else self.address


class Picker:
    """Routes exchanges with the service's dispatcher; knows engines by ``host:port``."""

    def __init__(self, service: RoutingService, *, fallbacks: int = 0) -> None:
        self.service = service
        self.fallbacks = fallbacks
        self.decider = Decider(
            service.settings, service.dispatcher, metrics=service.metrics, clock=service.clock
        )
        self._addresses: dict[str, str] = {}
        """engine URL -> host:port (bounded by the fleet: one entry per URL seen)."""

    def address(self, engine: EngineState) -> str:
        found = self._addresses.get(engine.url)
        if found is None:
            if len(self._addresses) > 4 * len(self.service.registry) + 64:
                self._addresses.clear()  # engines came and went: forget the old ones
            found = self._addresses[engine.url] = address_of(engine.url)
        return found

    def engine_at(self, address: str) -> EngineState | None:
        """The engine listening at ``address`` (``host:port``), if kvgate knows it."""
        for engine in self.service.registry.all():
            if self.address(engine) == address:
                return engine
        return None

    def view(self, ex: Exchange, subset: frozenset[str] | None) -> ClusterView:
        s = self.service
        exclude = [
            e.id
            for e in s.registry.all()
            if (ex.pinned and e.id != ex.pinned)
            or (not ex.endpoint.disaggregates and e.role is EngineRole.PREFILL)
            or (subset is not None and self.address(e) not in subset)
        ]
        return s.registry.view(
            s.dispatcher.in_flight, model=ex.model, exclude=exclude, queues=s.dispatcher.queues
        )

    async def pick(self, ex: Exchange, subset: frozenset[str] | None) -> Pick:
        """Route ``ex`` (a 503 when no engine is eligible, a 429 when its queue is full)."""
        s = self.service
        if s.flow is not None:  # flow control: waits while the engines saturate, or 429/503
            await s.flow.admit_info(ex.info)
        view = self.view(ex, subset)
        if not any(e.healthy for e in view.engines):
            s.metrics.requests.labels(ex.route, s.policy_name, "no_engine").inc()
            detail = (
                "no engine of the proxy's endpoint subset can serve this request"
                if subset is not None
                else "no healthy engine serves this model"
            )
            wait = s.registry.retry_after(s.clock())
            raise ApiError(503, detail, headers={"Retry-After": str(wait)})
        decision = self._route(ex, view)
        engine_id, hit = decision.engine, decision.expected_hit_tokens
        if decision.hold:
            engine_id, hit = await self._held(ex)
        reason = (decision.pd_reason or "unknown") if view.disaggregated else "unified"
        ex.pd_reason = reason
        s.metrics.pd_decisions.labels(reason).inc()
        engine = s.registry.get(engine_id)
        if engine is None:  # pragma: no cover - removed between view and decision
            s.dispatcher.finished(ex.info, engine_id, s.clock(), ok=False)
            raise ApiError(503, "the chosen engine left the fleet", headers={"Retry-After": "1"})
        pick = Pick(engine, self.address(engine), hit_tokens=hit, reason=decision.reason)
        if decision.prefill_engine is not None:
            prefill = s.registry.get(decision.prefill_engine)
            if prefill is not None:
                pick.prefill, pick.prefill_address = prefill, self.address(prefill)
                ex.prefill_engine = prefill.id
                pick.hit_tokens = ex.info.prompt_tokens  # the decode engine loads the KV
        s.metrics.pd_legs.labels("unified" if not view.disaggregated else "local").inc()
        if self.fallbacks and not ex.pinned:
            pick.fallbacks = self._fallbacks(view, engine.id)
        ex.engine = engine.id
        ex.attempts = 1
        s.registry.add_pending(engine.id, ex.request_id, max(0, ex.info.prompt_tokens - hit))
        s.registry.begin_attempt(engine.id, ex.request_id, lora=ex.info.lora)
        return pick

    def _fallbacks(self, view: ClusterView, chosen: str) -> tuple[str, ...]:
        others = sorted(
            (e for e in view.engines if e.healthy and e.id != chosen and e.serves_decode),
            key=lambda e: (e.in_flight + e.router_queued, e.pending_prefill_tokens),
        )
        out: list[str] = []
        for e in others[: self.fallbacks]:
            engine = self.service.registry.get(e.id)
            if engine is not None:
                out.append(self.address(engine))
        return tuple(out)

    def _route(self, ex: Exchange, view: ClusterView) -> Decision:
        return self.decider.route(ex, view)

    async def _held(self, ex: Exchange) -> tuple[str, int]:
        """Wait in the router queue until the pump releases the request (a cancelled
        wait: Envoy closed the stream while held)."""
        return await self.decider.held(ex)
