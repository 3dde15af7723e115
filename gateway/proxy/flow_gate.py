"""The gateway's side of flow control: requests wait on futures until admitted.

:class:`FlowGate` wraps the pure :class:`~gateway.flow.FlowController`. A front end calls
:func:`identify` (tenant and priority from the client's headers and body) when it builds the
request's ``RequestInfo``, then ``await gate.admit(ex)`` before routing:

* admitted (the engines are not saturated and nobody waits): returns at once;
* queued: waits until :meth:`FlowGate.pump` grants it (called when a request finishes or
  streams its first token, and every ``tick_s`` while anything waits: scrapes change the
  engines' state too), then returns;
* refused (its class or the queue is full), or shed later for a better request: raises a
  429 ``rate_limit_error``; waited past its timeout: a 503. Both carry ``Retry-After``.

``kvgate epp`` calls the same methods (:meth:`admit_info` takes a bare ``RequestInfo``).
After admission the body's ``priority`` goes to the engine as ``engine_priority`` says.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.config_flow import FlowControlConfig
from gateway.core.types import ClusterView, RequestInfo
from gateway.flow import (
    FlowController,
    FlowItem,
    FlowOutcome,
    PriorityError,
    SaturationDetector,
    priority_of,
    tenant_of,
)
from gateway.flow.controller import Sharpen
from gateway.flow.saturation import drained_tokens
from gateway.perfmodel.model import PerfModel
from gateway.policies.ttft_estimate import step_rate
from gateway.proxy.errors import ApiError
from gateway.proxy.exchange import Exchange
from gateway.proxy.flow_metrics import FlowMetrics

_PRIORITY_ROUTES = ("chat", "completions")
"""Routes whose body takes vLLM's ``priority`` (``engine_priority: set``)."""


DRAIN_SLACK = 2.0
"""A pending request counts as prefilled once twice the performance model's time for it (and
for those ahead) has passed: an engine up to 2x slower than its preset is still seen queued."""

PendingLog = Callable[[str], Sequence[tuple[float, int]]]
"""An engine's pending requests: (seconds since routed, prompt tokens), oldest first."""


def build_flow_gate(
    cfg: FlowControlConfig,
    perf: PerfModel,
    view: Callable[[str | None], ClusterView],
    clock: Callable[[], float],
    registry: CollectorRegistry | None,
    *,
    pending_log: PendingLog | None = None,
) -> FlowGate | None:
    """The gate of ``flow_control`` (None when it is off), its metrics on ``registry``."""
    if not cfg.enabled:
        return None
    gate = FlowGate(cfg, perf, view, clock, pending_log=pending_log)
    if registry is not None:
        gate.metrics = FlowMetrics(registry, gate.controller.queue, cfg.metrics_max_tenants)
    return gate


def identify(
    cfg: FlowControlConfig, headers: Mapping[str, str], body: Mapping[str, Any]
) -> tuple[str, int]:
    """(tenant, priority) of a request; a 400 for a priority that is not an integer."""
    try:
        priority = priority_of(headers, body, cfg.priority_header)
    except PriorityError as exc:
        raise ApiError(400, str(exc), param="priority") from None
    return tenant_of(headers, cfg.tenant_header), priority


class FlowGate:
    """Admission for the live gateway: the controller, futures, a timer while requests wait."""

    def __init__(
        self,
        cfg: FlowControlConfig,
        perf: PerfModel,
        view: Callable[[str | None], ClusterView],
        clock: Callable[[], float],
        metrics: FlowMetrics | None = None,
        *,
        tick_s: float = 0.02,
        pending_log: PendingLog | None = None,
    ) -> None:
        self.cfg = cfg
        self.perf = perf
        self.controller = FlowController(
            cfg.flow_settings(), SaturationDetector(cfg.saturation_settings(), perf)
        )
        self.cluster_view = view
        self.pending_log = pending_log
        """With it, an engine's pending prefill is at most what it has worked through since,
        at half the performance model's speed (:data:`DRAIN_SLACK`,
        :func:`~gateway.flow.saturation.drained_tokens`)."""
        self.clock = clock
        self.metrics = metrics
        self.tick_s = tick_s
        self._timer: asyncio.TimerHandle | None = None

    def view(self, model: str | None) -> ClusterView:
        """The cluster as the saturation detector sees it (the drained view)."""
        return self.drained(self.cluster_view(model))

    @property
    def _sharpen(self) -> Sharpen | None:
        return self.drained if self.pending_log is not None else None

    def drained(self, view: ClusterView) -> ClusterView:
        """``view`` with each engine's pending prefill lowered to what the engine cannot
        have prefilled yet at :data:`DRAIN_SLACK` times the model's time (computed only
        when the plain view says saturated: it can only lower the load)."""
        log = self.pending_log
        if log is None:
            return view
        engines = []
        for e in view.engines:
            mine = log(e.id)
            local = sum(n for _, n in mine)
            slowdown = step_rate(self.perf, e).slowdown
            left = drained_tokens(
                ((-age, n) for age, n in mine),
                0.0,
                lambda n: DRAIN_SLACK * self.perf.prefill_time(n) * slowdown,  # noqa: B023
            )
            pending = e.pending_prefill_tokens - local + min(local, left)
            engines.append(replace(e, pending_prefill_tokens=max(0, pending)))
        return ClusterView(tuple(engines))

    async def admit(self, ex: Exchange) -> None:
        """Wait until ``ex`` may be routed (or raise its 429/503); then set the engine's
        ``priority`` field as configured."""
        await self.admit_info(ex.info)
        mode = self.cfg.engine_priority
        if mode == "passthrough" or ex.body is None or ex.route not in _PRIORITY_ROUTES:
            return
        if mode == "set" and ex.body.get("priority") != ex.info.priority:
            ex.body["priority"] = ex.info.priority
        elif mode == "strip" and "priority" in ex.body:
            del ex.body["priority"]
        else:
            return
        ex.raw = json.dumps(ex.body, separators=(",", ":")).encode()

    async def admit_info(self, info: RequestInfo) -> None:
        """Admission of one request (any front end): returns when admitted."""
        ctl = self.controller
        now = self.clock()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        item = ctl.make_item(
            info.id,
            info.tenant,
            info.priority,
            info.prompt_tokens,
            now,
            handle=future,
            payload=info,
        )
        got = ctl.submit(item, self.cluster_view(info.model or None), now, sharpen=self._sharpen)
        if got.shed is not None:
            self._refuse(got.shed, "shed", 429)
        if got.outcome is FlowOutcome.ADMITTED:
            self._count_admitted(item, "direct", 0.0)
            return
        if got.outcome is FlowOutcome.REFUSED:
            self._count_refused(item, "queue_full")
            raise self._error(item, "queue_full", 429)
        self._arm()
        try:
            await future
        except BaseException:  # shed, timed out, or the client left (granted or not)
            ctl.cancel(item.id)
            raise
        ctl.started(item.id)
        self._count_admitted(item, "queued", self.clock() - item.enqueued)
        loop.call_soon(self.pump)  # the next one, once this one is routed

    def pump(self) -> None:
        """Time out waits past their deadline; grant the next request if the engines have
        room. Safe to call any time (on request end, first token, a timer)."""
        ctl = self.controller
        if not len(ctl.queue):
            return
        now = self.clock()
        for late in ctl.expire(now):
            self._refuse(late, "timeout", 503)
        head = ctl.queue.peek()
        if head is None or ctl.granted:
            return
        model = head.payload.model if isinstance(head.payload, RequestInfo) else None
        item = ctl.next_ready(self.cluster_view(model or None), now, sharpen=self._sharpen)
        if item is None:
            return
        future = item.handle
        if isinstance(future, asyncio.Future) and not future.done():
            future.set_result(None)
        else:  # its client already left
            ctl.started(item.id)

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.pump()
        if len(self.controller.queue):
            self._arm()

    def _refuse(self, item: FlowItem, reason: str, status: int) -> None:
        self._count_refused(item, reason)
        future = item.handle
        if isinstance(future, asyncio.Future) and not future.done():
            future.set_exception(self._error(item, reason, status))

    def _error(self, item: FlowItem, reason: str, status: int) -> ApiError:
        retry = str(self.controller.retry_after(self.clock()))
        if status == 503:
            return ApiError(
                503,
                f"waited {self.controller.settings.timeout(item.priority):g} s for the engines "
                "to have room (flow control); retry later",
                headers={"Retry-After": retry},
            )
        what = "was shed for a higher-priority request" if reason == "shed" else "is full"
        return ApiError(
            429,
            f"the flow-control queue of priority {item.priority} {what}; retry later",
            headers={"Retry-After": retry},
            error_type="rate_limit_error",
        )

    def _count_admitted(self, item: FlowItem, path: str, waited: float) -> None:
        if self.metrics is not None:
            prio, tenant = self.metrics.labels(item.priority, item.tenant)
            self.metrics.admitted.labels(prio, tenant, path).inc()
            self.metrics.wait.labels(prio).observe(waited)
            if waited > 0:
                self.metrics.waited.labels(prio, tenant).inc(waited)

    def _count_refused(self, item: FlowItem, reason: str) -> None:
        if self.metrics is not None:
            prio, tenant = self.metrics.labels(item.priority, item.tenant)
            self.metrics.refused.labels(prio, tenant, reason).inc()
