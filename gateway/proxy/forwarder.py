"""Forward one request to an engine chosen by the policy, retrying before the first byte.

The attempt loop: build the view (engines serving the model, minus the ones
already tried), ask the dispatcher, send. Connection errors, timeouts and 5xx
answers *before any byte reached the client* are retried on another engine
with backoff, up to ``retries.max_attempts`` and within the retry budget
(:mod:`gateway.proxy.budget`; past it the request fails fast with a 503). Each
attempt's outcome feeds the engine's circuit breaker through the registry
(:mod:`gateway.cluster.breaker`). A 4xx from the engine is the
client's problem and is passed through. Once streaming has started the
response is committed: an upstream failure ends the stream with an OpenAI
error event and ``data: [DONE]``; a client disconnect closes the upstream
request (which makes vLLM abort it). Every path ends in exactly one
``Dispatcher.finished`` call per attempt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence

from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from gateway.cluster.registry import EngineRegistry, EngineState
from gateway.config import Settings
from gateway.core.types import ClusterView, Decision, EngineRole
from gateway.observability import GatewayMetrics
from gateway.perfmodel.presets import load_preset
from gateway.policies.dispatcher import Dispatcher
from gateway.proxy.budget import RetryBudget, budget_error
from gateway.proxy.decide import Decider
from gateway.proxy.disagg import decode_body, note_pd_decision, run_prefill
from gateway.proxy.errors import ApiError
from gateway.proxy.exchange import Exchange
from gateway.proxy.flow_gate import FlowGate, build_flow_gate
from gateway.proxy.pump import QueuePump
from gateway.proxy.recorder import Recorder
from gateway.proxy.relay import Relay, completion_tokens
from gateway.proxy.response_store import ResponseStore, response_id_in
from gateway.proxy.settle import Settler
from gateway.proxy.upstream import Upstream, UpstreamConnectError, UpstreamError, UpstreamResponse
from gateway.tracing import begin_request

log = logging.getLogger("kvgate.proxy")


class _RetryableError(Exception):
    def __init__(self, reason: str, detail: str, *, immediate: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.immediate = immediate


class Forwarder:
    """Routes and proxies requests; owns no state beyond its collaborators'."""

    def __init__(
        self,
        settings: Settings,
        upstream: Upstream,
        registry: EngineRegistry,
        dispatcher: Dispatcher,
        metrics: GatewayMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        responses: ResponseStore | None = None,
        pump: QueuePump | None = None,
        flow: FlowGate | None = None,
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        self.registry = registry
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.clock = clock
        self.policy = dispatcher.policy.name
        self.decider = Decider(settings, dispatcher, metrics=metrics, clock=clock)
        self.settler = Settler(
            settings, registry, dispatcher=dispatcher, metrics=metrics, clock=clock, pump=self.pump
        )
        self.budget = RetryBudget.from_config(settings.retries)
        self.flow: FlowGate | None = flow or build_flow_gate(
            settings.flow_control,
            load_preset(settings.preset),
            self._view,
            clock,
            metrics.registry,
            pending_log=registry.pending_log,
        )
        """Flow control (admission, priority, fairness) in front of the policy (the routing
        service's gate; a forwarder built alone makes its own); None: off."""
        cfg = settings.responses
        self.responses = responses or ResponseStore(
            registry,
            ttl_s=cfg.ttl_s,
            max_entries=cfg.max_entries,
            clock=clock,
            locate=cfg.locate,
        )
        self.queue_pump = pump or QueuePump(registry, dispatcher, clock)
        self.on_model_missing: Callable[[str], None] | None = None
        """Called with an engine's id when it answered 404 to a routed request (its model
        list may be stale: the monitor re-reads it)."""

    @property
    def recorder(self) -> Recorder | None:
        """The traffic recorder (None: off); settled requests are recorded there."""
        return self.settler.recorder

    @recorder.setter
    def recorder(self, value: Recorder | None) -> None:
        self.settler.recorder = value

    async def forward(self, ex: Exchange) -> Response:
        """Route and proxy ``ex``; with a recorder, a request refused here is recorded too."""
        ex.trace = begin_request(ex)
        if self.recorder is None:
            return await self._forward(ex)
        try:
            return await self._forward(ex)
        except ApiError as exc:
            self.recorder.record(ex, ok=False, outcome=f"rejected_{exc.status}", output=None)
            raise
        except asyncio.CancelledError:
            self.recorder.record(ex, ok=False, outcome="cancelled", output=None)
            raise

    async def _forward(self, ex: Exchange) -> Response:
        if self.flow is not None:  # waits while the engines are saturated (or 429/503)
            waited = self.clock() if ex.trace is not None else 0.0
            await self.flow.admit(ex)
            if ex.trace is not None:
                ex.trace.queue_wait(self.clock() - waited)
        retries = self.settings.retries
        tried: list[str] = []
        last: _RetryableError | None = None
        self.budget.request(self.clock())
        for attempt in range(retries.max_attempts):
            view = self._view(ex.model, tried, ex)
            if tried and not any(e.healthy for e in view.engines):
                # every other engine was tried: one still in routing may be retried (a stale
                # keep-alive connection, say, fails once and then works)
                view = self._view(ex.model, (), ex)
            if not any(e.healthy for e in view.engines):
                break
            decision = self._route(ex, view)
            engine_id, hit = decision.engine, decision.expected_hit_tokens
            if decision.hold:
                engine_id, hit = await self._held(ex)
            ex.payload = ex.raw
            ex.prefill_engine = None
            note_pd_decision(self, ex, decision, view.disaggregated)
            if ex.trace is not None:
                ex.trace.decided(self.policy, decision.reason, engine_id, hit, ex.pd_reason)
            if decision.prefill_engine is not None:
                leg = await run_prefill(self, ex, decision.prefill_engine)
                if leg.response is not None:  # the prefill engine refused the request
                    self._finish_refused(ex, engine_id)
                    return leg.response
                if leg.params is not None:
                    ex.prefill_engine = decision.prefill_engine
                    assert ex.body is not None
                    ex.payload = decode_body(ex.body, leg.params)
                    hit = ex.info.prompt_tokens  # the decode engine loads the prompt's KV
            else:
                self.metrics.pd_legs.labels("unified" if not view.disaggregated else "local").inc()
            self.registry.add_pending(engine_id, ex.request_id, max(0, ex.info.prompt_tokens - hit))
            engine = self.registry.get(engine_id)
            if engine is None:  # pragma: no cover - removed between view and route
                self.dispatcher.finished(ex.info, engine_id, self.clock(), ok=False)
                tried.append(engine_id)
                continue
            ex.attempts = attempt + 1
            ex.engine = engine.id
            if ex.trace is not None:
                kind = "decode" if view.disaggregated else "attempt"
                ex.trace.begin_leg(kind, engine.id, ex.attempts)
            self.registry.begin_attempt(engine.id, ex.request_id, lora=ex.info.lora)
            try:
                if ex.stream:
                    return await self._stream(ex, engine)
                return await self._unary(ex, engine)
            except asyncio.CancelledError:  # the client left: free a half-open trial slot
                self.registry.end_attempt(engine.id, ex.request_id)
                raise
            except _RetryableError as exc:
                last = exc
                self._failed_attempt(ex, engine, exc)
                tried.append(engine.id)
                if attempt + 1 < retries.max_attempts:
                    if not self.budget.allow_retry(self.clock()):
                        self.metrics.retry_budget_exhausted.labels(ex.route).inc()
                        self.metrics.requests.labels(ex.route, self.policy, "retry_budget").inc()
                        raise budget_error(ex.attempts, exc.detail) from None
                    self.metrics.retries.labels(ex.route, exc.reason).inc()
                    await asyncio.sleep(min(retries.backoff_max_s, retries.backoff_s * 2**attempt))
        outcome = "no_engine" if last is None else "engine_error"
        self.metrics.requests.labels(ex.route, self.policy, outcome).inc()
        detail = (
            "no healthy engine serves this model"
            if last is None
            else (
                f"no engine could serve the request after {ex.attempts} attempt(s); "
                f"last error: {last.detail}"
            )
        )
        wait = self.registry.retry_after(self.clock()) if last is None else 1
        raise ApiError(503, detail, headers={"Retry-After": str(wait)})

    # -- one attempt -------------------------------------------------------------
    def _view(
        self, model: str | None, exclude: Sequence[str] = (), ex: Exchange | None = None
    ) -> ClusterView:
        """Engines serving ``model`` less ``exclude``; for ``ex``, only its pinned engine, and
        no prefill-only engine unless its endpoint runs disaggregated."""
        if ex is not None and (ex.pinned or not ex.endpoint.disaggregates):
            out = set(exclude)
            for e in self.registry.all():
                if (ex.pinned and e.id != ex.pinned) or (
                    not ex.endpoint.disaggregates and e.role is EngineRole.PREFILL
                ):
                    out.add(e.id)
            exclude = tuple(out)
        return self.registry.view(
            self.dispatcher.in_flight, model=model, exclude=exclude, queues=self.dispatcher.queues
        )

    def _route(self, ex: Exchange, view: ClusterView) -> Decision:
        return self.decider.route(ex, view)

    async def _held(self, ex: Exchange) -> tuple[str, int]:
        return await self.decider.held(ex)

    def pump(self, engine: str | None = None) -> None:
        """Release held requests (of ``engine``, or of every queue) the policy lets go."""
        if self.flow is not None:  # capacity may have freed: flow control's next request
            self.flow.pump()
        self.queue_pump.pump(engine)

    async def run_pump(self, interval_s: float) -> None:
        """Rebalance and release held requests on a timer."""
        await self.queue_pump.run(interval_s, self.pump)

    def headers_for(self, ex: Exchange, engine: EngineState) -> list[tuple[bytes, bytes]]:
        return self._headers(ex, engine)

    def prefill_failed(self, engine_id: str, detail: str, reason: str) -> None:
        """A prefill leg failed before its answer: count it against the prefill engine."""
        self.metrics.engine_errors.labels(engine_id, "prefill_" + reason).inc()
        if self.registry.mark_failure(
            engine_id, detail, self.clock(), immediate=reason == "connect"
        ):
            log.warning("engine %s taken out of routing: %s", engine_id, detail)

    def _finish_refused(self, ex: Exchange, engine_id: str) -> None:
        self.dispatcher.finished(ex.info, engine_id, self.clock(), ok=False)
        self.metrics.requests.labels(ex.route, self.policy, "engine_client_error").inc()
        self.pump(engine_id)
        if self.recorder is not None:
            self.recorder.record(ex, ok=False, outcome="engine_client_error", output=None)

    def _headers(self, ex: Exchange, engine: EngineState) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-request-id", ex.request_id.encode())]
        if ex.method == "POST":
            headers.append((b"content-type", ex.content_type.encode("latin-1")))
        if engine.api_key:
            headers.append((b"authorization", b"Bearer " + engine.api_key.encode()))
        client = ex.client_headers if ex.trace is None else ex.trace.headers(ex.client_headers)
        for name, value in client.items():
            headers.append((name.encode(), value.encode()))
        return headers

    def engine_headers(self, engine: EngineState) -> list[tuple[bytes, bytes]]:
        """The headers of a request kvgate itself sends to ``engine`` (a stored-response
        lookup)."""
        if engine.api_key:
            return [(b"authorization", b"Bearer " + engine.api_key.encode())]
        return []

    def _response_headers(self, ex: Exchange) -> dict[str, str]:
        headers = {"x-request-id": ex.request_id}
        if self.settings.expose_engine_header and ex.engine:
            headers["x-kvgate-engine"] = ex.engine
        return headers

    async def _send(self, ex: Exchange, engine: EngineState) -> UpstreamResponse:
        try:
            resp = await self.upstream.send(
                engine.url + ex.path,
                self._headers(ex, engine),
                ex.payload or ex.raw,
                method=ex.method,
            )
        except UpstreamError as exc:
            raise _RetryableError(
                exc.reason, str(exc), immediate=isinstance(exc, UpstreamConnectError)
            ) from None
        if resp.status >= 500:
            try:
                content = await resp.read()
            except UpstreamError:
                content = b""
            raise _RetryableError(f"status_{resp.status}", _upstream_detail(resp.status, content))
        return resp

    async def _unary(self, ex: Exchange, engine: EngineState) -> Response:
        resp = await self._send(ex, engine)
        try:
            content = await resp.read()
        except UpstreamError as exc:
            raise _RetryableError(exc.reason, str(exc)) from None
        now = self.clock()
        self.registry.clear_pending(engine.id, ex.request_id)
        ok = resp.status < 400
        self._stored_state(ex, engine, resp.status, content)
        output = completion_tokens(content) if ok else None
        if ok:
            self.dispatcher.first_token(ex.info, engine.id, now)
            self.metrics.ttft.labels(ex.route).observe(now - ex.started)
        outcome = "ok" if ok else "engine_client_error"
        self.finish(ex, engine, ok=ok, output=output, outcome=outcome, usage=content)
        return Response(
            content=content,
            status_code=resp.status,
            media_type=_content_type(resp),
            headers=self._response_headers(ex),
        )

    async def _stream(self, ex: Exchange, engine: EngineState) -> Response:
        resp = await self._send(ex, engine)
        if resp.status != 200:
            try:
                content = await resp.read()
            except UpstreamError as exc:
                raise _RetryableError(exc.reason, str(exc)) from None
            self.registry.clear_pending(engine.id, ex.request_id)
            self._stored_state(ex, engine, resp.status, content)
            self.finish(ex, engine, ok=False, output=None, outcome="engine_client_error")
            return Response(
                content=content,
                status_code=resp.status,
                media_type=_content_type(resp),
                headers=self._response_headers(ex),
            )
        chunks = resp.chunks()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except UpstreamError as exc:
            await resp.close()
            raise _RetryableError(exc.reason, str(exc)) from None
        now = self.clock()
        self.registry.clear_pending(engine.id, ex.request_id)
        self.dispatcher.first_token(ex.info, engine.id, now)
        self.metrics.ttft.labels(ex.route).observe(now - ex.started)
        self.pump(engine.id)
        relay = Relay(self, ex, engine, resp=resp, first=first, chunks=chunks)
        return StreamingResponse(
            relay.run(),
            media_type="text/event-stream",
            headers={**self._response_headers(ex), "cache-control": "no-cache"},
            background=BackgroundTask(relay.close),
        )

    # -- bookkeeping -------------------------------------------------------------
    def _stored_state(self, ex: Exchange, engine: EngineState, status: int, content: bytes) -> None:
        """What an answer tells about stored responses and the engine's models: bind a new
        stored response, forget a deleted one, have a 404's model list re-read."""
        if status == 200:
            if ex.store_response:
                self.bind_response(ex, engine, content)
            elif ex.method == "DELETE" and ex.response_id:
                self.responses.forget(ex.response_id)
        elif status == 404 and ex.endpoint.kind != "stored" and self.on_model_missing:
            self.on_model_missing(engine.id)

    def bind_response(self, ex: Exchange, engine: EngineState, content: bytes) -> bool:
        """Bind the id of the Responses object starting ``content`` to ``engine``."""
        response_id = response_id_in(content)
        if response_id is None:
            return False
        ex.store_response = False  # once per request
        self.responses.bind(response_id, engine.id)
        return True

    def _failed_attempt(self, ex: Exchange, engine: EngineState, exc: _RetryableError) -> None:
        if ex.trace is not None:
            ex.trace.end_leg(error=exc.reason)
        self.registry.end_attempt(engine.id, ex.request_id)
        self.registry.clear_pending(engine.id, ex.request_id)
        self.dispatcher.finished(ex.info, engine.id, self.clock(), ok=False)
        self.pump(engine.id)
        self.metrics.engine_errors.labels(engine.id, exc.reason).inc()
        if self.registry.mark_failure(engine.id, exc.detail, self.clock(), immediate=exc.immediate):
            log.warning(
                "engine %s taken out of routing: %s",
                engine.id,
                exc.detail,
                extra={"request_id": ex.request_id},
            )
        log.info(
            "attempt %d on %s failed: %s",
            ex.attempts,
            engine.id,
            exc.detail,
            extra={"request_id": ex.request_id, "engine": engine.id},
        )

    def finish(
        self,
        ex: Exchange,
        engine: EngineState,
        *,
        ok: bool,
        output: int | None,
        outcome: str,
        usage: bytes = b"",
    ) -> None:
        """Bookkeeping of a request an engine answered; ``usage``: bytes holding its usage."""
        self.settler.settle(ex, engine.id, ok=ok, output=output, outcome=outcome, usage=usage)


def _content_type(resp: UpstreamResponse) -> str:
    value = resp.header(b"content-type")
    return value.decode("latin-1") if value else "application/json"


def _upstream_detail(status: int, content: bytes) -> str:
    try:
        message = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = content[:200].decode("utf-8", "replace")
    return f"engine answered {status}: {message}"
