"""kvgate's own Prometheus metrics (on an injected registry) and structured JSON logs.

Metric names carry the ``kvgate_`` prefix and unit suffixes; labels are
bounded (route, policy, outcome, reason, engine) and never a request id.
Per-engine gauges are read from the engine registry at scrape time, so a
removed engine's series disappear with it.
"""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import queue
import sys
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as _Counter
from prometheus_client import Histogram as _Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.cluster.breaker import STATE_VALUE
from gateway.cluster.registry import EngineRegistry, Health
from gateway.policies.session_affinity import SessionAffinity, SessionOutcome


class _MemoLabels:
    """``labels(*values)`` memoised on the values as given: prometheus_client's own lookup
    (string conversion, validation, a lock) ran about ten times per request. Bounded by the
    metric's label cardinality, as its children are."""

    _memo: dict[tuple[object, ...], Any]

    def labels(self, *values: object, **named: object) -> Any:
        if named or not values:
            return super().labels(*values, **named)  # type: ignore[misc]
        try:
            return self._memo[values]
        except AttributeError:
            self._memo = {}
        except KeyError:
            pass
        child = self._memo[values] = super().labels(*values)  # type: ignore[misc]
        return child

    def remove(self, *values: object) -> None:
        self.__dict__.pop("_memo", None)
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self.__dict__.pop("_memo", None)
        super().clear()  # type: ignore[misc]


class Counter(_MemoLabels, _Counter):
    """A Prometheus counter whose ``labels()`` is memoised."""


class Histogram(_MemoLabels, _Histogram):
    """A Prometheus histogram whose ``labels()`` is memoised."""


_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_DECISION_BUCKETS = (
    5e-6,
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    0.1,
)


class GatewayMetrics:
    """Every metric the gateway exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvgate_requests",
            "Requests by route, policy and outcome",
            ["route", "policy", "outcome"],
            registry=r,
        )
        self.decisions = Counter(
            "kvgate_routing_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvgate_routing_decision_seconds",
            "Time to take one routing decision",
            ["policy"],
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvgate_time_to_first_token_seconds",
            "Gateway-observed time to the first byte of "
            "the answer (first SSE event when streaming)",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvgate_e2e_request_latency_seconds",
            "Gateway-observed end-to-end latency",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "kvgate_retries",
            "Requests retried on another engine, by reason",
            ["route", "reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvgate_routed_prompt_tokens",
            "Estimated prompt tokens routed",
            ["policy"],
            registry=r,
        )
        self.expected_hit_tokens = Counter(
            "kvgate_routed_expected_hit_tokens",
            "Prompt tokens the policy expected to be cached on the chosen engine",
            ["policy"],
            registry=r,
        )
        self.held = Counter(
            "kvgate_router_held",
            "Requests held in a router queue before dispatch",
            ["policy"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "kvgate_router_queue_wait_seconds",
            "Time held requests waited in the router queue",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pd_legs = Counter(
            "kvgate_pd_requests",
            "Disaggregated routing: remote prefill, local prefill on the "
            "decode engine, fallback after a failed prefill leg, or a unified pool",
            ["mode"],
            registry=r,
        )
        self.pd_decisions = Counter(
            "kvgate_pd_decisions",
            "Where each routing decision placed the prefill, and why (docs/disaggregation.md): "
            "remote_long, remote_uncached, local_short, local_cached, local_saturated, "
            "local_no_prefill, remote_priced/local_priced (a policy's own rule), unified",
            ["reason"],
            registry=r,
        )
        self.pd_prefill_seconds = Histogram(
            "kvgate_pd_prefill_seconds",
            "Duration of prefill legs (P/D)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.keys = Counter(
            "kvgate_routing_keys",
            "Routing keys by kind: exact engine tokens, or text chunks "
            "when tokens were not available",
            ["mode"],
            registry=r,
        )
        self.kv_event_batches = Counter(
            "kvgate_kv_event_batches",
            "KV event batches received, by engine",
            ["engine"],
            registry=r,
        )
        self.kv_event_resets = Counter(
            "kvgate_kv_event_resets",
            "Engine cache state resets (cleared, or events lost)",
            ["engine"],
            registry=r,
        )
        self.engine_errors = Counter(
            "kvgate_engine_errors",
            "Upstream failures by engine and kind",
            ["engine", "kind"],
            registry=r,
        )
        self.breaker_transitions = Counter(
            "kvgate_breaker_transitions",
            "Circuit breaker transitions by engine and new state (open, half_open, closed)",
            ["engine", "state"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "kvgate_retry_budget_exhausted",
            "Retries refused because the retry budget was spent (the request failed fast)",
            ["route"],
            registry=r,
        )
        self.overloaded = Counter(
            "kvgate_overload_rejected",
            "Requests refused with 503 because max_in_flight requests were in the gateway",
            registry=r,
        )
        self.rate_limited = Counter(
            "kvgate_rate_limited",
            "Requests refused with 429 by the per-client rate limit (rate_limit), by route",
            ["route"],
            registry=r,
        )

    def watch_engines(
        self, engines: EngineRegistry, in_flight: Callable[[], dict[str, int]]
    ) -> None:
        """Export per-engine gauges read from ``engines`` at scrape time."""
        self.registry.register(_EngineCollector(engines, in_flight))

    def watch_sessions(self, sessions: SessionAffinity) -> None:
        """Export session affinity's outcomes and bindings, read at scrape time."""
        self.registry.register(_SessionCollector(sessions))


class _SessionCollector(Collector):
    def __init__(self, sessions: SessionAffinity) -> None:
        self.sessions = sessions

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        outcomes = CounterMetricFamily(
            "kvgate_session_affinity",
            "Requests with a session id, by what affinity did: bound (sent to the session's "
            "engine), unrelated, rebound_saturated, rebound_unavailable, new, expired",
            labels=["outcome"],
        )
        counts = self.sessions.outcomes
        for outcome in SessionOutcome:
            outcomes.add_metric([outcome.value], counts.get(outcome.value, 0))
        yield outcomes
        yield GaugeMetricFamily(
            "kvgate_session_bindings",
            "Sessions bound to an engine (at most sessions.max_sessions)",
            value=len(self.sessions.table),
        )


class _EngineCollector(Collector):
    def __init__(self, engines: EngineRegistry, in_flight: Callable[[], dict[str, int]]) -> None:
        self.engines = engines
        self.in_flight = in_flight

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        healthy_count = GaugeMetricFamily(
            "kvgate_healthy_engines",
            "Engines taking traffic (0 when none is: the gateway answers 503)",
        )
        info = GaugeMetricFamily(
            "kvgate_engine_info",
            "1 per registered engine; labels: its role (both, prefill, decode)",
            labels=["engine", "role"],
        )
        fams = {
            "healthy": GaugeMetricFamily(
                "kvgate_engine_healthy", "1 when the engine takes traffic", labels=["engine"]
            ),
            "in_flight": GaugeMetricFamily(
                "kvgate_engine_in_flight", "Requests routed and not finished", labels=["engine"]
            ),
            "pending": GaugeMetricFamily(
                "kvgate_engine_pending_prefill_tokens",
                "Router estimate of prompt tokens sent and not yet prefilled",
                labels=["engine"],
            ),
            "waiting": GaugeMetricFamily(
                "kvgate_engine_waiting_requests",
                "Engine-reported waiting queue (scraped)",
                labels=["engine"],
            ),
            "running": GaugeMetricFamily(
                "kvgate_engine_running_requests",
                "Engine-reported running requests (scraped)",
                labels=["engine"],
            ),
            "kv": GaugeMetricFamily(
                "kvgate_engine_kv_cache_usage_ratio",
                "Engine-reported KV usage 0..1 (scraped)",
                labels=["engine"],
            ),
            "hit": GaugeMetricFamily(
                "kvgate_engine_prefix_cache_hit_ratio",
                "Engine-reported prefix cache hits / queries since start (scraped)",
                labels=["engine"],
            ),
            "breaker": GaugeMetricFamily(
                "kvgate_engine_breaker_state",
                "Circuit breaker: 0 closed, 1 half-open, 2 open",
                labels=["engine"],
            ),
            "lora": GaugeMetricFamily(
                "kvgate_engine_lora_adapters",
                "LoRA adapters the engine lists in /v1/models",
                labels=["engine"],
            ),
        }
        refreshes = CounterMetricFamily(
            "kvgate_engine_model_refreshes",
            "Reads of the engine's /v1/models by outcome (ok, error)",
            labels=["engine", "outcome"],
        )
        flights = self.in_flight()
        n_healthy = 0
        for e in self.engines.all():
            label = [e.id]
            healthy = e.health is Health.HEALTHY
            n_healthy += 1 if healthy else 0
            info.add_metric([e.id, str(e.role)], 1.0)
            fams["healthy"].add_metric(label, 1.0 if healthy else 0.0)
            fams["in_flight"].add_metric(label, float(flights.get(e.id, 0)))
            fams["pending"].add_metric(label, float(e.pending_tokens))
            fams["breaker"].add_metric(label, STATE_VALUE[e.breaker.state])
            fams["lora"].add_metric(label, float(len(e.lora)))
            refreshes.add_metric([e.id, "ok"], float(e.model_refreshes))
            refreshes.add_metric([e.id, "error"], float(e.model_refresh_failures))
            m = e.metrics
            if m is not None:
                fams["waiting"].add_metric(label, m.waiting)
                fams["running"].add_metric(label, m.running)
                fams["kv"].add_metric(label, m.kv_usage)
                if m.prefix_queries > 0:
                    fams["hit"].add_metric(label, m.prefix_hits / m.prefix_queries)
        healthy_count.add_metric([], float(n_healthy))
        yield healthy_count
        yield info
        yield from fams.values()
        yield refreshes


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any ``extra`` fields."""

    _RESERVED = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._RESERVED and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _DeferredQueueHandler(logging.handlers.QueueHandler):
    """Queues records unformatted: formatting and I/O happen on the listener thread."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


def configure_logging(level: str = "info") -> logging.handlers.QueueListener:
    """JSON logs on stderr for kvgate's loggers, written by a background thread.

    The request path only enqueues a record; returns the listener (already
    started) so a caller may stop it to flush at exit.
    """
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(JsonFormatter())
    listener = logging.handlers.QueueListener(records, stream, respect_handler_level=False)
    listener.start()
    atexit.register(listener.stop)
    root = logging.getLogger("kvgate")
    root.handlers[:] = [_DeferredQueueHandler(records)]
    root.setLevel(level.upper())
    root.propagate = False
    return listener
