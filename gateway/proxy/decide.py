"""One routing decision and its wait in the router queue (:class:`Decider`), shared by
every front end: the HTTP proxy's forwarder and the Envoy endpoint picker route the same
way, count the same metrics and answer a full or timed-out queue with the same errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gateway.config import Settings
from gateway.core.types import ClusterView, Decision
from gateway.observability import GatewayMetrics
from gateway.policies.dispatcher import Dispatcher
from gateway.policies.router_queues import QueuedRequest, QueueFullError
from gateway.proxy.errors import ApiError
from gateway.proxy.exchange import Exchange


class Decider:
    """Asks the dispatcher where a request goes, and waits out a hold."""

    def __init__(
        self,
        settings: Settings,
        dispatcher: Dispatcher,
        *,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.clock = clock
        self.policy = dispatcher.policy.name

    def route(self, ex: Exchange, view: ClusterView) -> Decision:
        """The policy's decision for ``ex`` on ``view``; a hold leaves its future on
        ``ex.held``. A full router queue is a 429."""
        t0 = time.perf_counter()
        future: asyncio.Future[QueuedRequest] = asyncio.get_running_loop().create_future()
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

    async def held(self, ex: Exchange) -> tuple[str, int]:
        """Wait in the router queue until released; (engine, expected hit) then. Past
        ``queue_timeout_s`` a 503; a cancelled wait (the client left) leaves the queue."""
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
        except asyncio.CancelledError:
            self.dispatcher.cancel(ex.request_id, self.clock())
            self.metrics.requests.labels(ex.route, self.policy, "cancelled").inc()
            raise
        finally:
            ex.held = None
        waited = self.clock() - ex.started
        self.metrics.queue_wait.observe(waited)
        if ex.trace is not None:
            ex.trace.queue_wait(waited)
        return item.engine, item.hit_tokens
