"""The ``tracing:`` settings: defaults, validation, environment variables."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import load_settings
from gateway.core.errors import ConfigError
from gateway.tracing.config import TracingConfig


def test_tracing_is_off_by_default_and_each_protocol_has_its_collector_address() -> None:
    cfg = load_settings().tracing
    assert cfg == TracingConfig()
    assert not cfg.enabled and cfg.protocol == "grpc" and cfg.sample_ratio == 1.0
    assert cfg.url == "http://127.0.0.1:4317"
    assert TracingConfig(protocol="http").url == "http://127.0.0.1:4318/v1/traces"
    assert TracingConfig(endpoint="http://otel:4317").url == "http://otel:4317"


@pytest.mark.parametrize(
    "bad",
    [
        {"sample_ratio": 1.5},
        {"sample_ratio": -0.1},
        {"protocol": "thrift"},
        {"service_name": ""},
        {"max_queue_size": 0},
        {"schedule_delay_s": 0},
        {"enable": True},  # a typo is an error, not a silent default
    ],
)
def test_invalid_tracing_settings_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises((ConfigError, ValueError)):
        load_settings(tracing=bad)


def test_tracing_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_TRACING__ENABLED", "true")
    monkeypatch.setenv("KVGATE_TRACING__PROTOCOL", "http")
    monkeypatch.setenv("KVGATE_TRACING__SAMPLE_RATIO", "0.25")
    cfg = load_settings().tracing
    assert (cfg.enabled, cfg.protocol, cfg.sample_ratio) == (True, "http", 0.25)
