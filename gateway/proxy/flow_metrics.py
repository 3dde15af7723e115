"""Prometheus metrics of flow control, per priority and tenant (bounded labels).

``kvgate_flow_queued{priority,tenant}`` (gauge, read from the queue at scrape time),
``kvgate_flow_wait_seconds{priority}`` (histogram of the wait of admitted requests),
``kvgate_flow_waited_seconds_total{priority,tenant}`` (their waits summed: a tenant's mean
wait is its rate over the rate of its ``path="queued"`` admissions),
``kvgate_flow_admitted_total{priority,tenant,path}`` (``direct`` or ``queued``) and
``kvgate_flow_refused_total{priority,tenant,reason}`` (``queue_full``, ``shed``,
``timeout``). At most ``max_tenants`` tenants and 16 priorities get their own label; later
ones count as ``other``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.flow import FairQueue
from gateway.observability import Counter, Histogram

MAX_PRIORITY_LABELS = 16
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Labels:
    """First-come label values up to a limit; the rest are ``other`` (bounded cardinality)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self.seen:
            return value
        if len(self.seen) < self.limit:
            self.seen.add(value)
            return value
        return "other"


class FlowMetrics:
    """The flow-control collectors on the gateway's registry."""

    def __init__(self, registry: CollectorRegistry, queue: FairQueue, max_tenants: int) -> None:
        self.tenant = _Labels(max_tenants)
        self.priority = _Labels(MAX_PRIORITY_LABELS)
        self.wait = Histogram(
            "kvgate_flow_wait_seconds",
            "Seconds admitted requests waited in flow control's queue",
            ["priority"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.waited = Counter(
            "kvgate_flow_waited_seconds_total",
            "Seconds admitted requests waited in flow control's queue, summed per tenant",
            ["priority", "tenant"],
            registry=registry,
        )
        self.admitted = Counter(
            "kvgate_flow_admitted_total",
            "Requests flow control admitted (path: direct, or queued first)",
            ["priority", "tenant", "path"],
            registry=registry,
        )
        self.refused = Counter(
            "kvgate_flow_refused_total",
            "Requests flow control refused (reason: queue_full, shed -> 429; timeout -> 503)",
            ["priority", "tenant", "reason"],
            registry=registry,
        )
        registry.register(_QueuedCollector(queue, self))

    def labels(self, priority: int, tenant: str) -> tuple[str, str]:
        return self.priority(str(priority)), self.tenant(tenant)


class _QueuedCollector(Collector):
    def __init__(self, queue: FairQueue, metrics: FlowMetrics) -> None:
        self.queue = queue
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "kvgate_flow_queued",
            "Requests waiting in flow control's queue",
            labels=["priority", "tenant"],
        )
        counts: dict[tuple[str, str], int] = {}
        for item in self.queue:
            key = self.metrics.labels(item.priority, item.tenant)
            counts[key] = counts.get(key, 0) + 1
        for (prio, tenant), n in sorted(counts.items()):
            g.add_metric([prio, tenant], n)
        yield g
