"""Admission and flow control: admit now, queue until the engines have room, or refuse.

The one object every driver uses (``kvgate serve``, ``kvgate epp``, the simulator):

* :meth:`FlowController.submit` — a request arrives. It is **admitted** at once when
  nothing is queued (or granted and not yet started) and the engines are not saturated
  (:mod:`gateway.flow.saturation`); else it is **queued** in the :class:`FairQueue`
  (priority first, fair across tenants); or **refused** (``queue_full``: its band or the
  queue is full and nobody worse can be shed). Queuing may **shed** a worse request.
* :meth:`FlowController.next_ready` — called when capacity may have freed (a request
  finished, a scrape, a timer): the next queued request if the engines can take it now.
  One request is *granted* at a time: the driver routes it, then calls
  :meth:`started`, so the next check sees the load it added.
* :meth:`FlowController.expire` — requests whose wait passed their timeout (503).
* :meth:`FlowController.cancel` — the client left.

Every request that enters ends in exactly one of: admitted, started after a grant,
refused, shed, timed out, cancelled. With ``enabled`` off every request is admitted.
Pure: the caller passes the clock's ``now`` and the cluster view, and optionally
``sharpen``: a closer, costlier look at a view that says saturated (it may only lower
the load the view shows), so the common case — nothing near saturation — pays for one
plain view and nothing more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from gateway.core.types import ClusterView, RequestInfo
from gateway.flow.queue import FairQueue, FlowItem
from gateway.flow.saturation import RecentPriorities, SaturationDetector

__all__ = ["Admission", "FlowController", "FlowOutcome", "FlowSettings", "FlowStats", "Sharpen"]

Sharpen = Callable[[ClusterView], ClusterView]
"""A closer look at a view that says saturated; it may only lower the load it shows."""


class FlowOutcome(StrEnum):
    ADMITTED = "admitted"
    QUEUED = "queued"
    REFUSED = "queue_full"


@dataclass(frozen=True, slots=True)
class FlowSettings:
    """Flow control's knobs (see ``flow_control:`` in docs/gateway.md)."""

    enabled: bool = True
    max_queued: int = 2_000
    max_queued_per_priority: int = 1_000
    queue_timeout_s: float = 30.0
    timeout_by_priority: Mapping[int, float] = field(default_factory=dict)
    """Per-priority wait limits, seconds (others wait ``queue_timeout_s``)."""
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    retry_after_s: int = 1
    """The least ``Retry-After`` of a refusal; more when the queue's drain time says so."""

    def timeout(self, priority: int) -> float:
        return self.timeout_by_priority.get(priority, self.queue_timeout_s)


@dataclass(frozen=True, slots=True)
class Admission:
    """What :meth:`FlowController.submit` did with a request."""

    outcome: FlowOutcome
    item: FlowItem
    shed: FlowItem | None = None
    """A worse request displaced from the queue to make room (answer it 429)."""
    reason: str = ""
    """Why it queued (the saturation reason) or was refused."""


@dataclass(slots=True)
class FlowStats:
    """Counters since start (bounded: a fixed set of numbers)."""

    admitted_direct: int = 0
    admitted_queued: int = 0
    refused: int = 0
    shed: int = 0
    timed_out: int = 0
    cancelled: int = 0
    served_cost: float = 0.0
    """Cost of the requests admitted from the queue (for the Retry-After drain estimate)."""
    queue_seconds: float = 0.0
    """Time requests admitted from the queue spent there, summed."""


class FlowController:
    """Admission in front of every policy: a fair priority queue and a saturation detector."""

    def __init__(self, settings: FlowSettings, detector: SaturationDetector) -> None:
        self.settings = settings
        self.detector = detector
        self.queue = FairQueue(
            max_total=settings.max_queued,
            max_per_priority=settings.max_queued_per_priority,
            weights=settings.tenant_weights,
        )
        self.granted: dict[str, FlowItem] = {}
        """Requests released from the queue that the driver has not started yet."""
        self.stats = FlowStats()
        self.recent = RecentPriorities(detector.settings.protect_window_s)
        """The priorities that arrived lately (the detector's limit for a mix of priorities)."""

    def _reason(
        self, item: FlowItem, view: ClusterView, now: float, sharpen: Sharpen | None
    ) -> str | None:
        req = item.payload if isinstance(item.payload, RequestInfo) else None
        mixed = self.recent.mixed(now)
        why = self.detector.reason(view, req, mixed=mixed)
        if why is not None and sharpen is not None:  # less load can only unsaturate
            why = self.detector.reason(sharpen(view), req, mixed=mixed)
        return why

    def make_item(
        self,
        req_id: str,
        tenant: str,
        priority: int,
        cost: float,
        now: float,
        *,
        handle: object = None,
        payload: RequestInfo | None = None,
    ) -> FlowItem:
        deadline = now + self.settings.timeout(priority)
        return FlowItem(
            req_id, tenant, priority, max(1.0, cost), now, deadline, handle=handle, payload=payload
        )

    def submit(
        self, item: FlowItem, view: ClusterView, now: float, *, sharpen: Sharpen | None = None
    ) -> Admission:
        """A request arrives: admit it, queue it, or refuse it."""
        if not self.settings.enabled:
            self.stats.admitted_direct += 1
            return Admission(FlowOutcome.ADMITTED, item)
        self.recent.saw(item.priority, now)
        reason = self._reason(item, view, now, sharpen)
        if reason is None and not len(self.queue) and not self.granted:
            self.stats.admitted_direct += 1
            return Admission(FlowOutcome.ADMITTED, item)
        queued, shed = self.queue.offer(item)
        if not queued:
            self.stats.refused += 1
            return Admission(FlowOutcome.REFUSED, item, reason="queue_full")
        if shed is not None:
            self.stats.shed += 1
        return Admission(FlowOutcome.QUEUED, item, shed=shed, reason=reason or "behind_queue")

    def next_ready(
        self, view: ClusterView, now: float, *, sharpen: Sharpen | None = None
    ) -> FlowItem | None:
        """The next queued request, granted, if the engines can take it now; else None."""
        if self.granted:
            return None
        head = self.queue.peek()
        if head is None:
            return None
        if self._reason(head, view, now, sharpen) is not None:
            return None
        item = self.queue.pop()
        assert item is head
        self.granted[item.id] = item
        self.stats.admitted_queued += 1
        self.stats.served_cost += item.cost
        self.stats.queue_seconds += max(0.0, now - item.enqueued)
        return item

    def started(self, item_id: str) -> None:
        """The driver routed a granted request (or gave up on it): the next may be granted."""
        self.granted.pop(item_id, None)

    def expire(self, now: float) -> list[FlowItem]:
        """Queued requests whose wait passed their timeout, removed (answer 503)."""
        out = self.queue.expired(now)
        self.stats.timed_out += len(out)
        return out

    def cancel(self, item_id: str) -> FlowItem | None:
        """The client left: drop its request from the queue (or its grant)."""
        self.granted.pop(item_id, None)
        item = self.queue.remove(item_id)
        if item is not None:
            self.stats.cancelled += 1
        return item

    def retry_after(self, now: float) -> int:
        """Seconds a refused client should wait: the queue's drain time at the rate the
        queue has been served, at least ``retry_after_s`` and at most 60."""
        low = self.settings.retry_after_s
        served = self.stats.admitted_queued
        if not served or not len(self.queue):
            return low
        per_request = self.stats.queue_seconds / served
        estimate = per_request if math.isfinite(per_request) else low
        return int(max(low, min(60, math.ceil(estimate))))

    def next_deadline(self) -> float | None:
        return self.queue.next_deadline()
