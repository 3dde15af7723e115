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
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from gateway.cluster.registry import EngineRegistry, EngineState
from gateway.config import Settings
from gateway.core.types import ClusterView, Decision, RequestInfo
from gateway.observability import GatewayMetrics
from gateway.policies.dispatcher import Dispatcher
from gateway.policies.router_queues import QueuedRequest, QueueFullError
from gateway.proxy.budget import RetryBudget, budget_error
from gateway.proxy.disagg import decode_body, note_pd_decision, pd_log_fields, run_prefill
from gateway.proxy.errors import ApiError
from gateway.proxy.recorder import Recorder
from gateway.proxy.relay import Relay, completion_tokens
from gateway.proxy.upstream import Upstream, UpstreamConnectError, UpstreamError, UpstreamResponse

log = logging.getLogger("kvgate.proxy")

FORWARD_HEADERS = ("x-vllm-priority", "x-session-id")
"""Client headers passed on to the engine; nothing else of the client's is forwarded."""
_JSON = (b"content-type", b"application/json")


@dataclass(slots=True)
class Exchange:
    """One client request on its way through the gateway."""

    route: str
    path: str
    raw: bytes
    info: RequestInfo
    model: str | None
    stream: bool
    request_id: str
    client_headers: dict[str, str] = field(default_factory=dict)
    started: float = 0.0
    attempts: int = 0
    engine: str | None = None
    held: asyncio.Future[QueuedRequest] | None = None
    body: dict[str, Any] | None = None
    payload: bytes = b""
    """What goes to the (decode) engine: ``raw``, or the decode leg's body in P/D."""
    prefill_engine: str | None = None
    """The engine that ran this attempt's remote prefill leg (P/D), if any."""
    pd_reason: str | None = None
    """Why the prefill ran where it did (P/D; ``unified`` without a prefill pool)."""


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
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        self.registry = registry
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.clock = clock
        self.policy = dispatcher.policy.name
        self.recorder: Recorder | None = None
        self.budget = RetryBudget.from_config(settings.retries)

    async def forward(self, ex: Exchange) -> Response:
        """Route and proxy ``ex``; with a recorder, a request refused here is recorded too."""
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
        retries = self.settings.retries
        tried: list[str] = []
        last: _RetryableError | None = None
        self.budget.request(self.clock())
        for attempt in range(retries.max_attempts):
            view = self._view(ex.model, tried)
            if tried and not any(e.healthy for e in view.engines):
                # every other engine was tried: one still in routing may be retried (a stale
                # keep-alive connection, say, fails once and then works)
                view = self._view(ex.model)
            if not any(e.healthy for e in view.engines):
                break
            decision = self._route(ex, view)
            engine_id, hit = decision.engine, decision.expected_hit_tokens
            if decision.hold:
                engine_id, hit = await self._held(ex)
            ex.payload = ex.raw
            ex.prefill_engine = None
            note_pd_decision(self, ex, decision, view.disaggregated)
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
            self.registry.begin_attempt(engine.id, ex.request_id)
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
    def _view(self, model: str | None, exclude: Sequence[str] = ()) -> ClusterView:
        return self.registry.view(
            self.dispatcher.in_flight, model=model, exclude=exclude, queues=self.dispatcher.queues
        )

    def _route(self, ex: Exchange, view: ClusterView) -> Decision:
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[QueuedRequest] = loop.create_future()
        try:
            decision = self.dispatcher.route(ex.info, view, self.clock(), handle=future)
        except QueueFullError as exc:
            self.metrics.requests.labels(ex.route, self.policy, "queue_full").inc()
            raise ApiError(
                429,
                f"{exc}; retry later",
                headers={"Retry-After": "1"},
                error_type="rate_limit_error",
            ) from None
        self.metrics.decision_seconds.labels(self.policy).observe(time.perf_counter() - t0)
        self.metrics.decisions.labels(self.policy, decision.reason or "none").inc()
        self.metrics.prompt_tokens.labels(self.policy).inc(ex.info.prompt_tokens)
        self.metrics.expected_hit_tokens.labels(self.policy).inc(
            min(decision.expected_hit_tokens, ex.info.prompt_tokens)
        )
        if decision.hold:
            ex.held = future
        return decision

    async def _held(self, ex: Exchange) -> tuple[str, int]:
        """Wait in the router queue until released; (engine, expected hit) then."""
        future = ex.held
        assert future is not None
        self.metrics.held.labels(self.policy).inc()
        try:
            item = await asyncio.wait_for(future, self.settings.queue_timeout_s)
        except TimeoutError:
            self.dispatcher.cancel(ex.request_id, self.clock())
            self.metrics.requests.labels(ex.route, self.policy, "queue_timeout").inc()
            raise ApiError(
                503,
                f"waited {self.settings.queue_timeout_s:g} s in the router queue",
                headers={"Retry-After": "1"},
            ) from None
        except asyncio.CancelledError:  # the client left while held
            self.dispatcher.cancel(ex.request_id, self.clock())
            self.metrics.requests.labels(ex.route, self.policy, "cancelled").inc()
            raise
        finally:
            ex.held = None
        self.metrics.queue_wait.observe(self.clock() - ex.started)
        return item.engine, item.hit_tokens

    def pump(self, engine: str | None = None) -> None:
        """Release held requests (of ``engine``, or of every queue) the policy lets go."""
        queues = self.dispatcher.queues
        if not len(queues):
            return
        now = self.clock()
        view = self._view(None)
        if engine is None:
            for target in self.dispatcher.rebalance(view, now):
                self._wake(target, view, now)
            for name in queues.engines():
                self._wake(name, view, now)
        else:
            self._wake(engine, view, now)

    def _wake(self, engine: str, view: ClusterView, now: float) -> None:
        for item in self.dispatcher.release(engine, view, now):
            future = item.handle
            if isinstance(future, asyncio.Future) and not future.done():
                future.set_result(item)

    async def run_pump(self, interval_s: float) -> None:
        """Rebalance and release held requests on a timer (engine state also changes when
        no request of ours completes: scrapes, other clients)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.pump()
            except Exception:  # pragma: no cover - never let the pump die
                log.exception("router queue pump failed")

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
        headers = [_JSON, (b"x-request-id", ex.request_id.encode())]
        if engine.api_key:
            headers.append((b"authorization", b"Bearer " + engine.api_key.encode()))
        for name, value in ex.client_headers.items():
            headers.append((name.encode(), value.encode()))
        return headers

    def _response_headers(self, ex: Exchange) -> dict[str, str]:
        headers = {"x-request-id": ex.request_id}
        if self.settings.expose_engine_header and ex.engine:
            headers["x-kvgate-engine"] = ex.engine
        return headers

    async def _send(self, ex: Exchange, engine: EngineState) -> UpstreamResponse:
        try:
            resp = await self.upstream.send(
                engine.url + ex.path, self._headers(ex, engine), ex.payload or ex.raw
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
    def _failed_attempt(self, ex: Exchange, engine: EngineState, exc: _RetryableError) -> None:
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
        now = self.clock()
        self.registry.end_attempt(engine.id, ex.request_id)
        info = ex.info if output is None else replace(ex.info, output_tokens=output)
        self.dispatcher.finished(info, engine.id, now, ok=ok)
        self.pump(engine.id)
        if ok:
            self.registry.mark_success(engine.id, now)
            self.metrics.e2e.labels(ex.route).observe(now - ex.started)
        self.metrics.requests.labels(ex.route, self.policy, outcome).inc()
        if self.settings.log_requests:
            log.info(
                "request done",
                extra={
                    "request_id": ex.request_id,
                    "route": ex.route,
                    "model": ex.model,
                    "engine": engine.id,
                    "outcome": outcome,
                    "attempts": ex.attempts,
                    "stream": ex.stream,
                    "prompt_tokens_est": ex.info.prompt_tokens,
                    "output_tokens": output,
                    "duration_s": round(now - ex.started, 6),
                    **pd_log_fields(ex),
                },
            )
        if self.recorder is not None:
            self.recorder.record(ex, ok=ok, outcome=outcome, output=output, usage=usage)


def _content_type(resp: UpstreamResponse) -> str:
    value = resp.header(b"content-type")
    return value.decode("latin-1") if value else "application/json"


def _upstream_detail(status: int, content: bytes) -> str:
    try:
        message = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = content[:200].decode("utf-8", "replace")
    return f"engine answered {status}: {message}"
