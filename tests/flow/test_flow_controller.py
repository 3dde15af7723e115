"""Admission: no effect until the engines saturate; then queue, grant one at a time, refuse,
time out; tenant and priority from a request; the saturation detector's thresholds."""

from __future__ import annotations

import pytest

from gateway.core.types import ClusterView, EngineView, RequestInfo, SloClass
from gateway.flow import (
    FlowController,
    FlowOutcome,
    FlowSettings,
    PriorityError,
    SaturationDetector,
    SaturationSettings,
    key_tenant,
    priority_of,
    tenant_of,
)
from gateway.flow.saturation import RecentPriorities, drained_tokens
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.policies.ttft_estimate import wait_s

PERF = load_preset(DEFAULT_PRESET)
IDLE = ClusterView((EngineView("e0"), EngineView("e1")))
BUSY = ClusterView((EngineView("e0", num_waiting=20), EngineView("e1", kv_usage=0.99)))


def controller(**kw: object) -> FlowController:
    return FlowController(FlowSettings(**kw), SaturationDetector(SaturationSettings(), PERF))  # type: ignore[arg-type]


def test_idle_engines_admit_everything_at_once() -> None:
    ctl = controller()
    for i in range(50):
        assert ctl.submit(ctl.make_item(f"r{i}", "t", 0, 10, 0.0), IDLE, 0.0).outcome == "admitted"
    assert not len(ctl.queue)


def test_saturated_engines_queue_then_grant_one_at_a_time_in_priority_order() -> None:
    ctl = controller()
    for i, prio in enumerate((5, 0, 5)):
        got = ctl.submit(ctl.make_item(f"r{i}", "t", prio, 10, 0.0), BUSY, 0.0)
        assert got.outcome is FlowOutcome.QUEUED
    assert ctl.next_ready(BUSY, 1.0) is None  # still saturated
    first = ctl.next_ready(IDLE, 1.0)
    assert first is not None and first.id == "r1"
    assert ctl.next_ready(IDLE, 1.0) is None  # r1 not started yet
    ctl.started("r1")
    # a new arrival queues behind the others even though the engines have room
    assert ctl.submit(ctl.make_item("r9", "t", 0, 10, 1.0), IDLE, 1.0).outcome == "queued"
    assert [ctl.next_ready(IDLE, 1.0).id, ctl.started("r9")][0] == "r9"  # type: ignore[union-attr]


def test_full_queue_refuses_and_waits_time_out() -> None:
    ctl = controller(max_queued=2, queue_timeout_s=5.0, timeout_by_priority={0: 1.0})
    assert ctl.submit(ctl.make_item("a", "t", 0, 1, 0.0), BUSY, 0.0).outcome == "queued"
    assert ctl.submit(ctl.make_item("b", "t", 3, 1, 0.0), BUSY, 0.0).outcome == "queued"
    assert ctl.submit(ctl.make_item("c", "t", 3, 1, 0.0), BUSY, 0.0).outcome == "queue_full"
    assert [i.id for i in ctl.expire(1.0)] == ["a"]
    assert [i.id for i in ctl.expire(5.0)] == ["b"]
    assert ctl.stats.refused == 1 and ctl.stats.timed_out == 2


def test_disabled_admits_even_when_saturated() -> None:
    ctl = controller(enabled=False)
    assert ctl.submit(ctl.make_item("a", "t", 0, 1, 0.0), BUSY, 0.0).outcome == "admitted"


@pytest.mark.parametrize(
    ("engine", "reason"),
    [
        (EngineView("e", num_waiting=7), None),
        (EngineView("e", num_waiting=8), "waiting"),
        (EngineView("e", kv_usage=0.95), "kv"),
        (EngineView("e", pending_prefill_tokens=10), None),
        (EngineView("e", pending_prefill_tokens=10_000_000), "ttft"),
        (EngineView("e", num_waiting=99, healthy=False), None),
    ],
)
def test_saturation_thresholds(engine: EngineView, reason: str | None) -> None:
    detector = SaturationDetector(SaturationSettings(), PERF)
    assert detector.reason(ClusterView((engine,))) == reason


def test_ttft_limit_is_the_slo_target_capped() -> None:
    detector = SaturationDetector(SaturationSettings(max_ttft_s=2.0), PERF)
    fast = RequestInfo("r", (), 10, 0.0, slo=SloClass("interactive", 0.5, 0.05))
    slow = RequestInfo("r", (), 10, 0.0, slo=SloClass("batch", 60.0, 0.5))
    assert detector.ttft_limit(fast) == 0.5 and detector.ttft_limit(slow) == 2.0


def test_tenant_is_a_hash_of_the_key_or_the_configured_header() -> None:
    key = "sk-secret-123"
    tenant = tenant_of({"authorization": f"Bearer {key}"})
    assert tenant == key_tenant(key) and key not in tenant and tenant.startswith("key:")
    assert tenant_of({"x-api-key": key}) == tenant
    assert tenant_of({}) == "anonymous"
    assert tenant_of({"x-tenant": "team-a", "x-api-key": key}, "X-Tenant") == "team-a"
    assert tenant_of({"x-api-key": key}, "x-tenant") == tenant


def test_priority_from_the_body_and_the_header_overrides() -> None:
    assert priority_of({}, {}) == 0
    assert priority_of({}, {"priority": -3}) == -3
    assert priority_of({"x-kvgate-priority": "7"}, {"priority": -3}) == 7
    for bad in ({"priority": "high"}, {"priority": 1.5}, {"priority": True}):
        with pytest.raises(PriorityError):
            priority_of({}, bad)
    with pytest.raises(PriorityError):
        priority_of({"x-kvgate-priority": "x"}, {})


def test_a_mix_of_priorities_caps_the_ttft_limit() -> None:
    detector = SaturationDetector(SaturationSettings(max_ttft_s=2.0, protect_ttft_s=0.05), PERF)
    slow = RequestInfo("r", (), 10, 0.0, slo=SloClass("batch", 60.0, 0.5))
    assert detector.ttft_limit(slow) == 2.0
    assert detector.ttft_limit(slow, mixed=True) == 0.05
    off = SaturationDetector(SaturationSettings(max_ttft_s=2.0, protect_ttft_s=0.0), PERF)
    assert off.ttft_limit(slow, mixed=True) == 2.0


def test_the_short_queue_holds_only_while_priorities_are_mixed() -> None:
    # one prefill of 2,000 tokens queued: over protect_ttft_s, under max_ttft_s
    view = ClusterView((EngineView("e0", pending_prefill_tokens=2_000),))
    ctl = controller()
    limits = ctl.detector.settings
    assert limits.protect_ttft_s < wait_s(PERF, view.engines[0]) < limits.max_ttft_s
    for i in range(3):  # one priority only: no effect
        assert ctl.submit(ctl.make_item(f"b{i}", "t", 10, 10, i), view, i).outcome == "admitted"
    # an interactive request arrives: from now on both classes meet the short limit
    assert ctl.submit(ctl.make_item("i0", "t", 0, 10, 3.0), view, 3.0).outcome == "queued"
    assert ctl.submit(ctl.make_item("b3", "t", 10, 10, 4.0), view, 4.0).outcome == "queued"
    assert ctl.next_ready(view, 4.0) is None
    got = ctl.next_ready(IDLE, 4.0)
    assert got is not None and got.id == "i0"
    ctl.started("i0")
    assert ctl.next_ready(IDLE, 4.0) is not None
    ctl.started("b3")
    # the mix is forgotten protect_window_s after the interactive class last arrived
    late = 3.0 + limits.protect_window_s + 1.0
    assert ctl.submit(ctl.make_item("b4", "t", 10, 10, late), view, late).outcome == "admitted"


def test_recent_priorities_stay_bounded() -> None:
    recent = RecentPriorities(window_s=10.0, limit=4)
    for p in range(100):
        recent.saw(p, 1.0)
    assert len(recent._last) == 4 and recent.mixed(1.0)
    assert not recent.mixed(20.0)
    lone = RecentPriorities(window_s=10.0)
    lone.saw(3, 0.0)
    lone.saw(3, 5.0)
    assert not lone.mixed(5.0)


def test_drained_tokens_work_through_the_log_first_come_first_served() -> None:
    def one_per_thousand(tokens: int) -> float:
        return tokens / 1_000.0

    assert drained_tokens([], 5.0, one_per_thousand) == 0
    assert drained_tokens([(0.0, 2_000)], 1.5, one_per_thousand) == 2_000
    assert drained_tokens([(0.0, 2_000)], 2.5, one_per_thousand) == 0
    # the second waits for the first (done at 1 s) and is done at 3 s
    log = [(0.0, 1_000), (0.5, 2_000)]
    assert drained_tokens(log, 0.9, one_per_thousand) == 3_000
    assert drained_tokens(log, 2.9, one_per_thousand) == 2_000
    assert drained_tokens(log, 3.1, one_per_thousand) == 0
    # one routed after both were done waits for nobody
    assert drained_tokens([*log, (10.0, 1_000)], 10.5, one_per_thousand) == 1_000


def test_sharpen_runs_only_when_the_plain_view_says_saturated() -> None:
    """The costly closer look (the gateway's drained pending prefill) is skipped while the
    plain view has room, and decides when it does not."""
    ctl = controller()
    looks: list[ClusterView] = []

    def sharpen(view: ClusterView) -> ClusterView:
        looks.append(view)
        return IDLE

    assert (
        ctl.submit(ctl.make_item("a", "t", 0, 10, 0.0), IDLE, 0.0, sharpen=sharpen).outcome
        == "admitted"
    )
    assert looks == []  # room already: no closer look
    got = ctl.submit(ctl.make_item("b", "t", 0, 10, 0.0), BUSY, 0.0, sharpen=sharpen)
    assert got.outcome == "admitted" and looks == [BUSY]  # the closer look found room
    assert ctl.submit(ctl.make_item("c", "t", 0, 10, 0.0), BUSY, 0.0).outcome == "queued"
    assert ctl.next_ready(BUSY, 1.0) is None
    ready = ctl.next_ready(BUSY, 1.0, sharpen=sharpen)
    assert ready is not None and ready.id == "c"
