"""The shared-queue bound: one global KV pool, a central work-conserving queue, capacity.

That no policy beats it on TTFT mean / p50 is checked with the pooled bound in
test_bound.py (the same policy runs serve both).
"""

from __future__ import annotations

import pytest

from gateway.core.types import DEFAULT_SLO
from gateway.perfmodel.presets import load_preset
from gateway.sim.bound import bound_capacity
from gateway.sim.loop import ClusterSpec
from gateway.sim.metrics import summarize
from gateway.sim.runner import SimulateOptions, capacity_search, run_policy, simulate
from gateway.sim.shared_queue import (
    SHARED_QUEUE_NAME,
    SharedQueueSimulation,
    attach_shared_queue,
    run_shared_queue,
    shared_queue_capacity,
)
from gateway.sim.workloads import Workload, WorkloadOptions, WorkloadRequest, load_workload

PERF = load_preset("mistral-7b-a6000")


def _request(i: int, arrival: float, hashes: tuple[int, ...], output: int = 20) -> WorkloadRequest:
    return WorkloadRequest(
        id=f"r{i}",
        arrival=arrival,
        prompt_tokens=len(hashes) * 16 + 8,
        output_tokens=output,
        block_hashes=hashes,
        slo=DEFAULT_SLO,
    )


def test_engines_share_one_pool_of_n_times_the_blocks() -> None:
    wl = load_workload("gen:no_sharing?n=5&rate=1", WorkloadOptions())
    sim = SharedQueueSimulation(ClusterSpec(3, PERF), wl)
    assert sim.pool.capacity == 3 * PERF.kv_capacity_blocks
    assert all(e.pool is sim.pool for e in sim.engines)


def test_a_prefix_computed_anywhere_is_a_hit_everywhere() -> None:
    prefix = tuple(range(1000, 1100))  # 100 blocks
    reqs = [
        _request(0, 0.0, prefix, output=400),  # keeps its engine busy decoding
        _request(1, 5.0, (*prefix, 7, 8)),
        _request(2, 5.0, (*prefix, 9, 10)),
    ]
    wl = Workload("prefix", tuple(reqs), 16)
    run = run_shared_queue(wl, ClusterSpec(2, PERF))
    by_id = {r.source.id: r for r in run.records}
    assert by_id["r1"].engine != by_id["r2"].engine  # both engines serve ...
    assert by_id["r1"].cached_tokens == by_id["r2"].cached_tokens == 100 * 16  # ... both hit
    apart = run_policy("round_robin", wl, ClusterSpec(2, PERF))
    assert min(r.cached_tokens for r in apart.records[1:]) == 0  # separate caches


def test_work_conserving_no_engine_idles_while_a_request_waits() -> None:
    reqs = [_request(i, 0.0, tuple(range(i * 500, i * 500 + 100))) for i in range(4)]
    run = run_shared_queue(Workload("burst", tuple(reqs), 16), ClusterSpec(4, PERF))
    assert {r.engine for r in run.records} == {f"sq-{i}" for i in range(4)}
    assert all(r.queue_wait == 0.0 for r in run.records)
    # with 2 engines, the third and fourth wait for the first step boundary, no longer
    run2 = run_shared_queue(Workload("burst", tuple(reqs), 16), ClusterSpec(2, PERF))
    first_step = PERF.prefill_time(100 * 16 + 8)
    waits = sorted(r.queue_wait for r in run2.records)
    assert waits[:2] == [0.0, 0.0]
    assert 0 < waits[2] <= first_step * 1.01


def test_a_request_waits_for_a_prefix_in_flight_instead_of_recomputing_it() -> None:
    prefix = tuple(range(5000, 5120))  # 1,920 tokens, one step to compute
    reqs = [_request(0, 0.0, (*prefix, 1)), _request(1, 0.1, (*prefix, 2))]
    run = run_shared_queue(Workload("dup", tuple(reqs), 16), ClusterSpec(2, PERF))
    second = run.records[1]
    assert second.cached_tokens == 120 * 16  # waited for the first to compute it
    assert second.engine == "sq-0" and second.queue_wait > 0
    policy = run_policy("least_loaded", Workload("dup", tuple(reqs), 16), ClusterSpec(2, PERF))
    assert policy.records[1].cached_tokens == 0  # a router sends it elsewhere: recomputed


def test_admission_never_preempts() -> None:
    small = PERF.with_overrides(kv_capacity_blocks=400)
    wl = load_workload("gen:no_sharing?n=120&rate=40&prompt_tokens=1500", WorkloadOptions())
    cluster = ClusterSpec(2, small)
    assert summarize(run_policy("round_robin", wl, cluster))["preemptions"] > 0
    s = summarize(run_shared_queue(wl, cluster))
    assert s["preemptions"] == 0 and s["completed"] == len(wl) - s["rejected"]


def test_rejects_what_one_engine_cannot_hold() -> None:
    small = PERF.with_overrides(kv_capacity_blocks=100, max_model_len=100_000)
    wl = load_workload("gen:no_sharing?n=40&rate=2&prompt_tokens=1200", WorkloadOptions())
    cluster = ClusterSpec(4, small)
    policy = summarize(run_policy("round_robin", wl, cluster))
    bound = summarize(run_shared_queue(wl, cluster))
    assert policy["rejected"] > 0 and bound["rejected"] == policy["rejected"]


@pytest.mark.parametrize("spec", ["gen:chat?n=150&rate=1", "gen:zipf_hotspot?n=300&rate=10"])
def test_capacity_between_round_robin_and_the_pooled_bound(spec: str) -> None:
    wl = load_workload(spec, WorkloadOptions())
    cluster = ClusterSpec(4, PERF)
    rr, _ = capacity_search("round_robin", wl, cluster)
    shared, runs = shared_queue_capacity(wl, cluster)
    pooled, _ = bound_capacity(wl, cluster)
    assert rr < shared <= pooled
    assert runs >= 6  # bracketed, then bisected to 2 %


def test_attach_shared_queue_adds_the_bound_and_fractions() -> None:
    wl = load_workload("gen:tool_use?n=60&rate=10", WorkloadOptions())
    cluster = ClusterSpec(2, PERF)
    opts = SimulateOptions(policies=["round_robin", "cache_aware"], cluster=cluster, capacity=True)
    results = simulate(wl, opts).results
    attach_shared_queue(results, wl, cluster, capacity=True)
    bound = results[SHARED_QUEUE_NAME]
    assert bound["engines"] == 2 and bound["capacity_rps"] > 0
    for pol in results["policies"].values():
        vs = pol["vs_shared_queue"]
        assert vs["capacity_rps"] == pytest.approx(pol["capacity_rps"] / bound["capacity_rps"])
        assert 0 < vs["ttft_mean"] <= 1
