"""The engine model's costs outside its steps: the frontend term and the idle wake."""

from __future__ import annotations

import pytest

from gateway.perfmodel.engine import EngineCore, EngineRequest
from gateway.perfmodel.model import PerfModel
from gateway.sim.loop import ClusterSpec
from gateway.sim.runner import run_policy
from gateway.sim.workloads import Workload, WorkloadRequest

BASE = PerfModel(name="t", prefill_a=5.0, prefill_b=0.01, decode_e0=4.0, decode_e1=0.5)


def request(i: int, arrival: float = 0.0, prompt: int = 100, out: int = 3) -> EngineRequest:
    return EngineRequest(f"r{i}", prompt, (), out, arrival)


def run(core: EngineCore, now: float) -> float:
    """Step ``core`` until it has no work; the time it ends."""
    while core.has_work:
        end = core.start_step(now)
        assert end is not None
        core.finish_step()
        now = end
    return now


def test_defaults_are_zero_so_datasheet_results_do_not_move() -> None:
    assert (BASE.frontend_ms, BASE.frontend_per_stream_ms, BASE.idle_wake_ms) == (0, 0, 0)
    assert BASE.frontend_delay(16) == 0.0 and BASE.wake_delay(1e9) == 0.0


def test_an_idle_engine_starts_its_first_step_late() -> None:
    model = BASE.with_overrides(idle_wake_ms=30.0, idle_after_s=1.0)
    core = EngineCore("e", model, max_decode_run=1)
    core.submit(request(0))
    first = core.start_step(0.0)  # idle since it started
    assert first == pytest.approx(0.030 + model.prefill_time(100))
    core.finish_step()
    done = run(core, first)
    core.submit(request(1, done + 0.5))  # idle 0.5 s < 1 s: no wake
    assert core.start_step(done + 0.5) == pytest.approx(done + 0.5 + model.prefill_time(100))
    core.finish_step()
    later = run(core, done + 0.5) + 1.001  # idle past idle_after_s: wakes slowly
    core.submit(request(2, later))
    assert core.start_step(later) == pytest.approx(later + 0.030 + model.prefill_time(100))


def test_tokens_reach_the_client_a_frontend_delay_later_growing_with_streams() -> None:
    model = BASE.with_overrides(frontend_ms=2.0, frontend_per_stream_ms=0.5)
    assert model.frontend_delay(1) == pytest.approx(0.002)
    assert model.frontend_delay(5) == pytest.approx(0.004)
    core = EngineCore("e", model, max_decode_run=1)
    reqs = [request(i) for i in range(4)]
    for r in reqs:
        core.submit(r)
    run(core, 0.0)
    for r in reqs:  # all four produced a token in the steps of their first and last tokens
        assert r.client_first_token_time == pytest.approx(r.first_token_time + 0.0035)
        assert r.client_finish_time == pytest.approx(r.finish_time + 0.0035)


def test_the_simulator_reports_what_the_client_sees() -> None:
    model = BASE.with_overrides(frontend_ms=3.0, idle_wake_ms=20.0, idle_after_s=1.0)
    reqs = (
        WorkloadRequest("a", 0.0, 64, 1, ()),
        WorkloadRequest("b", 0.1, 64, 1, ()),  # engine busy 0.1 s ago: awake
        WorkloadRequest("c", 5.0, 64, 1, ()),  # idle for ~5 s: wakes slowly
    )
    records = run_policy("round_robin", Workload("w", reqs, 16), ClusterSpec(1, model)).records
    cold = model.prefill_time(64) + 0.003
    assert [r.ttft for r in records] == pytest.approx([cold + 0.020, cold, cold + 0.020])


@pytest.mark.parametrize("field", ["frontend_ms", "frontend_per_stream_ms", "idle_wake_ms"])
def test_negative_costs_are_refused(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BASE.with_overrides(**{field: -1.0})
