"""The fleet-level gauges the alerts and dashboards use: healthy engine count, engine roles."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from gateway.cluster.registry import EngineRegistry
from gateway.core.types import EngineRole
from gateway.observability import Counter, GatewayMetrics

P, D1, D2 = "http://p:1", "http://d1:1", "http://d2:1"


def _metrics(engines: EngineRegistry) -> GatewayMetrics:
    metrics = GatewayMetrics()
    metrics.watch_engines(engines, lambda: {})
    return metrics


def test_healthy_engine_count_follows_health() -> None:
    engines = EngineRegistry(failure_threshold=1)
    metrics = _metrics(engines)
    value = metrics.registry.get_sample_value
    assert value("kvgate_healthy_engines") == 0.0  # exported even with no engine at all
    for url in (P, D1, D2):
        engines.add(url)
    assert value("kvgate_healthy_engines") == 0.0  # not probed yet
    engines.mark_success(P, 0.0)
    engines.mark_success(D1, 0.0)
    assert value("kvgate_healthy_engines") == 2.0
    engines.mark_failure(D1, "connect", 1.0)
    assert value("kvgate_healthy_engines") == 1.0
    assert value("kvgate_engine_healthy", {"engine": D1}) == 0.0
    engines.remove(P)
    assert value("kvgate_healthy_engines") == 0.0


def test_engine_info_carries_each_engines_role() -> None:
    engines = EngineRegistry()
    engines.add(P, role=EngineRole.PREFILL)
    engines.add(D1, role=EngineRole.DECODE)
    engines.add(D2 + "/")
    metrics = _metrics(engines)
    value = metrics.registry.get_sample_value
    assert value("kvgate_engine_info", {"engine": P, "role": "prefill"}) == 1.0
    assert value("kvgate_engine_info", {"engine": D1, "role": "decode"}) == 1.0
    assert value("kvgate_engine_info", {"engine": D2, "role": "both"}) == 1.0
    text = generate_latest(metrics.registry).decode()
    assert "# TYPE kvgate_healthy_engines gauge" in text
    assert "# TYPE kvgate_engine_info gauge" in text
    engines.remove(D1)
    assert value("kvgate_engine_info", {"engine": D1, "role": "decode"}) is None


def test_memoised_labels_count_into_the_exported_series() -> None:
    registry = CollectorRegistry()
    c = Counter("kvgate_t", "t", ["route", "outcome"], registry=registry)
    assert c.labels("chat", "ok") is c.labels("chat", "ok")  # one child per label values
    c.labels("chat", "ok").inc()
    c.labels(route="chat", outcome="ok").inc()  # by name: the same series
    c.labels("chat", "error").inc(2)
    text = generate_latest(registry).decode()
    assert 'kvgate_t_total{outcome="ok",route="chat"} 2.0' in text
    assert 'kvgate_t_total{outcome="error",route="chat"} 2.0' in text
    c.remove("chat", "ok")  # a removed series starts again from zero, not from a stale child
    c.labels("chat", "ok").inc()
    assert 'kvgate_t_total{outcome="ok",route="chat"} 1.0' in generate_latest(registry).decode()
