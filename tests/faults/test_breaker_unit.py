"""The breaker, its window, the retry budget and fault parsing, without processes."""

from __future__ import annotations

import random

import pytest

from gateway.cli import build_parser
from gateway.cli.emulate import settings_from_args
from gateway.cluster.breaker import (
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    SlidingWindow,
    breaker_config,
)
from gateway.cluster.registry import EngineRegistry, Health
from gateway.config import load_settings
from gateway.core.errors import ConfigError
from gateway.emulator.faults import FaultInjector, parse_fault
from gateway.proxy.budget import RetryBudget

CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def breaker(**cfg: float) -> CircuitBreaker:
    return CircuitBreaker(BreakerConfig(jitter=0.0, **cfg), random.Random(0))  # type: ignore[arg-type]


def test_consecutive_failures_open_then_half_open_then_closed() -> None:
    b = breaker(failure_threshold=2, cooldown_s=1.0)
    assert b.failure(0.0) is None and b.state is CLOSED
    assert b.failure(0.1) == (CLOSED, OPEN)
    assert not b.admits and b.open_until == pytest.approx(1.1)
    assert b.success(0.5) is None and b.state is OPEN  # too early
    assert b.poll(1.0) is None
    assert b.poll(1.2) == (OPEN, HALF)
    assert b.admits
    b.begin("trial")
    assert not b.admits  # one trial at a time
    assert b.success(1.3, probe=True) is None  # opened by requests: a probe does not count
    assert b.success(1.3) == (HALF, CLOSED)
    assert b.admits and not b.trials


def test_a_request_success_resets_the_run_but_a_probe_does_not() -> None:
    b = breaker(failure_threshold=2)
    b.failure(0.0)
    b.success(0.1, probe=True)
    assert b.failure(0.2) == (CLOSED, OPEN)
    b = breaker(failure_threshold=2)
    b.failure(0.0)
    b.success(0.1)
    assert b.failure(0.2) is None


def test_probe_trips_are_closed_by_probes_and_admit_no_trial_requests() -> None:
    b = breaker(failure_threshold=1, cooldown_s=1.0)
    b.failure(0.0, probe=True)
    b.poll(2.0)
    assert b.state is HALF and not b.admits and not b.trial_requests
    assert b.success(2.1, probe=True) == (HALF, CLOSED)
    b.failure(3.0, immediate=True)  # a refused connection is tested by probes too
    b.poll(10.0)
    assert not b.admits


def test_failure_rate_over_the_window_opens() -> None:
    b = breaker(failure_threshold=100, failure_rate=0.5, min_requests=10, window_s=10.0)
    for i in range(4):  # 8 outcomes, half of them failures: too few to judge
        assert b.success(i * 0.1) is None
        assert b.failure(i * 0.1 + 0.05) is None
    assert b.success(0.4) is None
    assert b.failure(0.45) == (CLOSED, OPEN)  # 10 outcomes, 5 failures


def test_cooldown_doubles_per_trip_up_to_the_cap_and_resets_after_a_calm_period() -> None:
    b = breaker(failure_threshold=1, cooldown_s=1.0, cooldown_max_s=4.0)
    now, cooldowns = 100.0, []
    for _ in range(4):
        b.failure(now)
        cooldowns.append(round(b.open_until - now, 3))
        now = b.open_until
        b.poll(now)
    assert cooldowns == [1.0, 2.0, 4.0, 4.0]
    b.success(now)
    assert b.state is CLOSED
    b.failure(now + 10.0)  # closed for longer than the cap: the backoff starts over
    assert b.open_until - (now + 10.0) == pytest.approx(1.0)


def test_jitter_spreads_cooldowns() -> None:
    spans = set()
    for seed in range(20):
        b = CircuitBreaker(BreakerConfig(failure_threshold=1, jitter=0.2), random.Random(seed))
        b.failure(0.0)
        assert 4.0 <= b.open_until <= 6.0
        spans.add(round(b.open_until, 3))
    assert len(spans) > 10


def test_sliding_window_forgets_old_buckets() -> None:
    w = SlidingWindow(10.0, buckets=10)
    w.add(0.0, a=5)
    w.add(5.0, a=1, b=1)
    assert w.totals(9.9) == (6, 1)
    assert w.totals(10.5) == (1, 1)
    assert w.totals(100.0) == (0, 0)


def test_retry_budget_allows_the_ratio_plus_the_floor() -> None:
    budget = RetryBudget(ratio=0.2, min_per_s=1.0, window_s=10.0)
    for _ in range(100):
        budget.request(0.0)
    allowed = sum(budget.allow_retry(0.0) for _ in range(100))
    assert allowed == 30 and budget.exhausted == 70  # 20 % of 100 + 1/s x 10 s
    assert budget.allow_retry(11.0)  # the window moved on


def test_registry_health_follows_the_breaker() -> None:
    cfg = breaker_config(load_settings(health={"cooldown_s": 1.0, "cooldown_jitter": 0.0}).health)
    reg = EngineRegistry(breaker=cfg, clock=lambda: 0.0)
    e = reg.add("http://a:1", model="m")
    assert reg.mark_success(e.id, 0.0, probe=True)  # first probe: healthy
    assert e.health is Health.HEALTHY and e.routable
    reg.mark_failure(e.id, "boom", 1.0)
    assert reg.mark_failure(e.id, "boom", 1.1)
    assert e.health is Health.UNHEALTHY and not e.routable
    assert reg.retry_after(1.2) == 1
    reg.poll(2.2)
    assert e.breaker.state is HALF and e.routable and e.admits
    reg.begin_attempt(e.id, "r1")
    assert not e.admits
    assert reg.mark_success(e.id, 2.3)
    reg.end_attempt(e.id, "r1")
    assert e.health is Health.HEALTHY and e.breaker.state is CLOSED


def test_fault_specs() -> None:
    assert parse_fault("midstream:3").arg == 3.0
    assert parse_fault("refuse").arg == 5.0
    assert parse_fault("http500", times=2).times == 2
    for bad, message in [
        ("nope", "unknown fault"),
        ("http500:1", "takes no argument"),
        ("slow_kv:x", "not a number"),
        ("hang:-1", "takes no argument"),
        ("slow_kv:-1", ">= 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_fault(bad)
    faults = FaultInjector(parse_fault("reset", times=2))
    assert faults.take("reset") and faults.take("reset") and not faults.take("reset")
    assert faults.fault is None and faults.applied == 2


def test_emulate_fault_flags() -> None:
    args = build_parser().parse_args(["emulate", "--fault", "midstream:2"])
    assert settings_from_args(args).fault == "midstream:2"
    args = build_parser().parse_args(["emulate", "--fault", "bogus"])
    with pytest.raises(ConfigError, match="unknown fault"):
        settings_from_args(args)
    plain = settings_from_args(build_parser().parse_args(["emulate"]))
    assert plain.fault is None and not plain.fault_admin


def test_an_emulator_without_fault_flags_has_no_fault_layer() -> None:
    from gateway.emulator.server import EmulatorSettings, create_emulator_app

    plain = create_emulator_app(EmulatorSettings())
    assert not plain.user_middleware
    assert "/_faults" not in plain.openapi()["paths"]
    faulty = create_emulator_app(EmulatorSettings(fault_admin=True))
    assert len(faulty.user_middleware) == 1
    assert "/_faults" in faulty.openapi()["paths"]
