"""The gateway's flow gate bounds an engine's pending prefill by what the performance model
says the engine has worked through since: a non-streamed request shows its first token only
with its whole answer, and would otherwise count as queued prefill until then."""

from __future__ import annotations

from gateway.cluster.registry import EngineRegistry
from gateway.config_flow import FlowControlConfig
from gateway.core.types import ClusterView, EngineView
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.proxy.flow_gate import FlowGate

PERF = load_preset(DEFAULT_PRESET)


def gate(log: dict[str, list[tuple[float, int]]]) -> FlowGate:
    def view(model: str | None) -> ClusterView:
        # e0: this replica's 2,000 tokens plus 300 of a peer's; e1: none pending
        return ClusterView((EngineView("e0", pending_prefill_tokens=2_300), EngineView("e1")))

    return FlowGate(
        FlowControlConfig(), PERF, view, lambda: 0.0, pending_log=lambda e: log.get(e, [])
    )


def test_an_old_pending_prefill_no_longer_counts() -> None:
    old = gate({"e0": [(30.0, 1_000), (20.0, 1_000)]}).view(None)
    assert [e.pending_prefill_tokens for e in old.engines] == [300, 0]
    fresh = gate({"e0": [(0.0, 1_000), (0.0, 1_000)]}).view(None)
    assert fresh.engines[0].pending_prefill_tokens == 2_300
    assert fresh.get("e1") is not None


def test_without_a_log_the_view_is_the_clusters() -> None:
    g = FlowGate(
        FlowControlConfig(),
        PERF,
        lambda m: ClusterView((EngineView("e0", pending_prefill_tokens=9),)),
        lambda: 0.0,
    )
    assert g.view(None).engines[0].pending_prefill_tokens == 9


def test_the_registry_logs_each_pending_request_with_its_age() -> None:
    now = [100.0]
    registry = EngineRegistry(clock=lambda: now[0])
    registry.add("http://e0:8000", model="m")
    registry.add_pending("http://e0:8000", "a", 300)
    now[0] = 101.0
    registry.add_pending("http://e0:8000", "b", 500)
    now[0] = 103.0
    assert registry.pending_log("http://e0:8000") == [(3.0, 300), (2.0, 500)]
    registry.clear_pending("http://e0:8000", "a")
    assert registry.pending_log("http://e0:8000") == [(2.0, 500)]
    assert registry.pending_log("http://nope:1") == []
    registry.clear_pending("http://e0:8000", "b")
    engine = registry.get("http://e0:8000")
    assert engine is not None and not engine.pending_since  # bounded: nothing left behind
