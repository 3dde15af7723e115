"""Which error a request for a model gets when no engine can take it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.cluster.registry import EngineRegistry
from gateway.proxy.errors import ApiError
from gateway.proxy.intake import resolve_model


def state_with(registry: EngineRegistry) -> object:
    return SimpleNamespace(registry=registry)


def status(registry: EngineRegistry, model: str | None) -> int:
    with pytest.raises(ApiError) as info:
        resolve_model(state_with(registry), model)  # type: ignore[arg-type]
    return info.value.status


def test_tripped_engines_of_one_model_give_503_not_404() -> None:
    clock = [0.0]
    reg = EngineRegistry(clock=lambda: clock[0])
    for url, model in [("http://a", "m1"), ("http://b", "m2")]:
        reg.add(url, model=model)
    assert resolve_model(state_with(reg), "m1") == "m1"  # type: ignore[arg-type]
    reg.mark_failure("http://a", "connection refused", 0.0, immediate=True)
    assert status(reg, "m1") == 503  # known model, its only engine is out: retry later
    assert status(reg, "nope") == 404  # never served here
    assert resolve_model(state_with(reg), "m2") == "m2"  # type: ignore[arg-type]
