"""The simulator end to end on small generated traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.perfmodel.model import PerfModel
from gateway.sim.loop import ClusterSpec, load_cv
from gateway.sim.metrics import cache_hit_upper_bound, percentile, summarize
from gateway.sim.runner import SimulateOptions, deterministic_view, run_policy, simulate
from gateway.sim.workloads import WorkloadOptions, load_workload

SMALL = PerfModel(
    name="small",
    prefill_a=2.0,
    prefill_b=0.05,
    prefill_c=1e-5,
    prefill_d=1e-6,
    decode_e0=8.0,
    decode_e1=0.05,
    decode_e2=1e-4,
    kv_capacity_blocks=3000,
    max_num_batched_tokens=2048,
    max_num_seqs=64,
)
POLICIES = ["round_robin", "least_loaded", "power_of_two", "cache_aware", "weighted_scorer"]


@pytest.fixture
def workload(mooncake_trace: Path):  # type: ignore[no-untyped-def]
    return load_workload(f"mooncake:{mooncake_trace}", WorkloadOptions())


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_completes_exactly_once(workload, policy: str) -> None:  # type: ignore[no-untyped-def]
    run = run_policy(policy, workload, ClusterSpec(4, SMALL))
    assert [r.source.id for r in run.records] == [r.id for r in workload.requests]
    for rec in run.records:
        assert rec.rejected is None
        assert rec.first_token_time is not None and rec.finish_time is not None
        assert rec.source.arrival <= rec.first_token_time <= rec.finish_time
        assert rec.cached_tokens % 16 == 0
        # TTFT is never below the request's own uncached prefill time
        own = SMALL.prefill_time(rec.source.prompt_tokens - rec.cached_tokens, rec.cached_tokens)
        assert rec.ttft is not None and rec.ttft >= own - 1e-9
    assert run.decision_seconds == []  # no timer injected


@pytest.mark.parametrize("policy", POLICIES)
def test_same_seed_same_results(workload, policy: str) -> None:  # type: ignore[no-untyped-def]
    a = summarize(run_policy(policy, workload, ClusterSpec(4, SMALL), seed=5))
    b = summarize(run_policy(policy, workload, ClusterSpec(4, SMALL), seed=5))
    assert a == b


def test_decode_runs_do_not_change_results(workload) -> None:  # type: ignore[no-untyped-def]
    fast = run_policy("cache_aware", workload, ClusterSpec(4, SMALL, max_decode_run=256))
    exact = run_policy("cache_aware", workload, ClusterSpec(4, SMALL, max_decode_run=1))
    assert fast.engine_steps == exact.engine_steps
    for a, b in zip(fast.records, exact.records, strict=True):
        assert a.engine == b.engine
        assert a.cached_tokens == b.cached_tokens
        assert a.first_token_time == pytest.approx(b.first_token_time, rel=1e-9)
        assert a.finish_time == pytest.approx(b.finish_time, rel=1e-9)
    assert fast.events < exact.events


def test_cache_aware_beats_round_robin_and_stays_under_bound(workload) -> None:  # type: ignore[no-untyped-def]
    opts = SimulateOptions(policies=["round_robin", "cache_aware"], cluster=ClusterSpec(4, SMALL))
    res = simulate(workload, opts).results
    bound = res["cache_hit_upper_bound"]
    rr = res["policies"]["round_robin"]["cache_hit_rate"]
    ca = res["policies"]["cache_aware"]["cache_hit_rate"]
    assert 0 < rr < ca <= bound <= 1
    assert res["instances"] == 4 and res["requests"] == len(workload)


def test_results_shape_and_determinism(workload) -> None:  # type: ignore[no-untyped-def]
    opts = SimulateOptions(policies=POLICIES, cluster=ClusterSpec(4, SMALL), seed=2)
    a = simulate(workload, opts, timer=lambda: 0.0).results
    b = simulate(workload, opts).results
    assert deterministic_view(a) == deterministic_view(b)
    keys = {
        "ttft_p50",
        "ttft_p90",
        "ttft_p99",
        "tpot_p50",
        "tpot_p99",
        "e2e_p50",
        "e2e_p99",
        "goodput",
        "throughput_rps",
        "cache_hit_rate",
        "load_cv_mean",
        "load_cv_p95",
        "decision_us_p50",
        "decision_us_p99",
        "completed",
        "preemptions",
        "capacity_rps",
    }
    for pol in a["policies"].values():
        assert keys <= set(pol)
        assert pol["capacity_rps"] is None
        assert 0.0 <= pol["goodput"] <= 1.0
    assert {"workload", "instances", "preset", "seed", "cache_hit_upper_bound"} <= set(a)


def test_capacity_search_brackets_the_slo(workload) -> None:  # type: ignore[no-untyped-def]
    opts = SimulateOptions(
        policies=["least_loaded"], cluster=ClusterSpec(2, SMALL), capacity=True, capacity_steps=3
    )
    pol = simulate(workload, opts).results["policies"]["least_loaded"]
    assert pol["capacity_rps"] is not None and pol["capacity_rps"] > 0
    assert pol["capacity_runs"] >= 2


def test_rejected_requests_are_counted() -> None:
    tiny = SMALL.with_overrides(max_model_len=600)
    wl = load_workload("gen:no_sharing?n=30&rate=5", WorkloadOptions())
    run = run_policy("round_robin", wl, ClusterSpec(2, tiny))
    s = summarize(run)
    too_long = sum(1 for r in wl.requests if r.prompt_tokens + r.output_tokens > 600)
    assert too_long > 0
    assert s["rejected"] == too_long
    assert s["completed"] == len(wl) - too_long


def test_percentile_and_cv() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert load_cv([0, 0, 0]) == 0.0
    assert load_cv([5, 5]) == 0.0
    assert load_cv([0, 10]) == pytest.approx(1.0)


def test_upper_bound_counts_each_block_once(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n'
        '{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n'
        '{"timestamp": 2, "input_length": 600, "output_length": 1, "hash_ids": [1, 3]}\n'
    )
    wl = load_workload(f"mooncake:{trace}", WorkloadOptions())
    # request 2 hits its first 1023 tokens' full blocks (63 of 64), request 3 hits block 1 (32)
    assert cache_hit_upper_bound(wl) == pytest.approx((63 * 16 + 32 * 16) / (1024 + 1024 + 600))
