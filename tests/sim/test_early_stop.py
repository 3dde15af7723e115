"""Early-stopped capacity probes: the same answers as full runs, reached sooner."""

from __future__ import annotations

import pytest

from gateway.core.types import DEFAULT_SLO, RequestInfo
from gateway.perfmodel.presets import load_preset
from gateway.sim.bound import bound_capacity
from gateway.sim.early_stop import MissBudget, ProbeFailed
from gateway.sim.loop import ClusterSpec, RequestRecord
from gateway.sim.metrics import slo_attainment
from gateway.sim.runner import capacity_search, probe_attainment, run_policy
from gateway.sim.shared_queue import run_shared_queue, shared_queue_capacity
from gateway.sim.workloads import WorkloadOptions, WorkloadRequest, load_workload

PERF = load_preset("mistral-7b-a6000")


def _record(i: int, arrival: float = 0.0) -> RequestRecord:
    src = WorkloadRequest(f"r{i}", arrival, 32, 10, (), DEFAULT_SLO)
    return RequestRecord(source=src, info=RequestInfo(f"r{i}", (), 32, arrival))


def test_budget_allows_exactly_the_misses_the_target_tolerates() -> None:
    budget = MissBudget(100, 0.9)
    assert budget.allowed == 10
    recs = [_record(i) for i in range(12)]
    for r in recs[:10]:
        budget.miss(r)
    budget.miss(recs[0])  # counted once
    with pytest.raises(ProbeFailed):
        budget.miss(recs[10])
    assert MissBudget(7, 0.9).allowed == 0  # ceil(6.3) = 7 must meet it


def test_deadlines_count_requests_without_a_first_token() -> None:
    budget = MissBudget(10, 0.5)  # 5 allowed
    recs = [_record(i, arrival=float(i)) for i in range(10)]
    for r in recs:
        budget.arrived(r)
    recs[0].first_token_time = 1.0  # in time
    recs[1].first_token_time = 7.0  # late (deadline 6.0)
    budget.advance(7.5)  # deadlines 5.0, 6.0, 7.0 passed
    assert budget.misses == 2
    with pytest.raises(ProbeFailed):
        budget.advance(100.0)


@pytest.mark.parametrize("spec", ["gen:chat?n=100&rate=0.5", "gen:tool_use?n=200&rate=12"])
def test_same_capacity_with_and_without_early_stop(spec: str) -> None:
    wl = load_workload(spec, WorkloadOptions())
    cluster = ClusterSpec(2, PERF)
    for name in ("least_loaded",):
        fast = capacity_search(name, wl, cluster)
        full = capacity_search(name, wl, cluster, early_stop=False)
        assert fast == full, name
    assert shared_queue_capacity(wl, cluster) == shared_queue_capacity(
        wl, cluster, early_stop=False
    )
    assert bound_capacity(wl, cluster) == bound_capacity(wl, cluster, early_stop=False)


def test_a_stopped_probe_is_a_failed_one() -> None:
    wl = load_workload("gen:chat?n=200&rate=6", WorkloadOptions())  # far past capacity
    cluster = ClusterSpec(4, PERF)
    full = slo_attainment(run_policy("round_robin", wl, cluster))
    assert full < 0.9
    got = probe_attainment(lambda b: run_policy("round_robin", wl, cluster, budget=b), 200, 0.9)
    assert got == 0.0
    ok = load_workload("gen:chat?n=200&rate=0.2", WorkloadOptions())
    full_ok = slo_attainment(run_shared_queue(ok, cluster))
    assert full_ok >= 0.9
    got_ok = probe_attainment(lambda b: run_shared_queue(ok, cluster, budget=b), 200, 0.9)
    assert got_ok == full_ok
