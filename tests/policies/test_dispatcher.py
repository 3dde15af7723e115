"""The dispatcher: validation, in-flight accounting, timing, hooks."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway.core.errors import NoEngineError
from gateway.core.types import ClusterView, Decision, EngineId, EngineView, RequestInfo
from gateway.policies import Dispatcher, PolicyBase, PolicyError


class Fixed(PolicyBase):
    name = "fixed"
    wants_cache_events = True

    def __init__(self, target: str) -> None:
        self.target = target
        self.calls: list[tuple[str, str]] = []

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        return Decision(engine=self.target)

    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        self.calls.append(("routed", decision.engine))

    def on_first_token(self, req: RequestInfo, engine: EngineId, now: float) -> None:
        self.calls.append(("first", engine))

    def on_finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        self.calls.append(("finished" if ok else "failed", engine))

    def on_cache_event(
        self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        self.calls.append(("cache", f"{engine}:{len(stored)}:{len(removed)}"))


VIEW = ClusterView((EngineView("a"), EngineView("b", healthy=False)))
REQ = RequestInfo(id="r", block_hashes=(), prompt_tokens=10, arrival=0.0)


def test_route_counts_in_flight_and_calls_hooks() -> None:
    policy = Fixed("a")
    d = Dispatcher(policy)
    assert d.route(REQ, VIEW, 0.0).engine == "a"
    assert d.in_flight == {"a": 1}
    d.first_token(REQ, "a", 1.0)
    d.cache_event("a", [1, 2], [])
    d.cache_event("a", [], [])  # empty events are not forwarded
    d.finished(REQ, "a", 2.0, ok=True)
    assert d.in_flight == {}
    assert policy.calls == [("routed", "a"), ("first", "a"), ("cache", "a:2:0"), ("finished", "a")]


@pytest.mark.parametrize("target", ["b", "zzz"])
def test_decision_for_unhealthy_or_unknown_engine_is_a_policy_error(target: str) -> None:
    with pytest.raises(PolicyError, match=target):
        Dispatcher(Fixed(target)).route(REQ, VIEW, 0.0)


def test_no_healthy_engine() -> None:
    dead = ClusterView((EngineView("a", healthy=False),))
    with pytest.raises(NoEngineError):
        Dispatcher(Fixed("a")).route(REQ, dead, 0.0)


def test_decision_timing_uses_injected_timer() -> None:
    ticks = iter([1.0, 1.5, 2.0, 2.25])
    d = Dispatcher(Fixed("a"), timer=lambda: next(ticks))
    d.route(REQ, VIEW, 0.0)
    d.route(REQ, VIEW, 0.0)
    assert d.times.samples == [0.5, 0.25]
