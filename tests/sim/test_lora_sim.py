"""LoRA traffic in the simulator: the ``gen:lora`` generator, adapters in requests and views."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway.core.types import ClusterView, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.policies.base import PolicyContext
from gateway.policies.recording import PolicySpec, RecordingPolicy
from gateway.sim.bound import pooled_perf
from gateway.sim.loop import ClusterSpec, SimRun, Simulation
from gateway.sim.lora_traffic import adapter_stats
from gateway.sim.metrics import summarize
from gateway.sim.runner import deterministic_view, run_policy
from gateway.sim.workloads import Workload, WorkloadOptions, WorkloadRequest, load_workload
from tests.sim.test_loop import SMALL

LORA = SMALL.with_overrides(max_loras=2, lora_load_s=0.2, lora_activate_s=0.01)


def test_generator_statistics_follow_the_parameters() -> None:
    wl = load_workload("gen:lora?n=3000&adapters=16&zipf=1.0&base_share=0.25")
    stats = adapter_stats(wl.requests)
    assert stats.base_share == pytest.approx(0.25, abs=0.03)
    assert stats.adapters == 16
    harmonic = sum(1 / k for k in range(1, 17))
    assert stats.top_share == pytest.approx(1 / harmonic, abs=0.03)  # Zipf 1: 1/H_16
    assert stats.top4_share == pytest.approx(sum(1 / k for k in range(1, 5)) / harmonic, abs=0.04)
    assert wl.rate == pytest.approx(8.0, rel=0.1)
    assert stats.line().startswith("3,000 requests: base 26%, 16 adapters, top 1 29% / top 4 61%")
    uniform = adapter_stats(load_workload("gen:lora?n=3000&zipf=0&base_share=0").requests)
    assert uniform.base_share == 0.0 and uniform.top_share < 0.1


def test_one_adapter_shares_its_system_prompts_and_no_block_crosses_adapters() -> None:
    wl = load_workload("gen:lora?n=400&adapters=4&systems=1&common_tokens=64&system_tokens=64")
    first: dict[str, set[int]] = {}
    for r in wl.requests:
        first.setdefault(r.lora, set()).add(r.block_hashes[0])
    # the common preamble is the same text everywhere, yet each adapter has its own block
    assert all(len(hashes) == 1 for hashes in first.values())
    assert len({h for hashes in first.values() for h in hashes}) == len(first) == 5


def _lora_names(requests: Sequence[WorkloadRequest]) -> set[str]:
    return {r.lora for r in requests}


def decisions(
    cluster: ClusterSpec, wl: Workload
) -> tuple[list[tuple[RequestInfo, ClusterView]], SimRun]:
    """What least_loaded was shown at each decision, and the run."""
    spec = PolicySpec.of("least_loaded", PolicyContext(perf=cluster.perf), None)
    rec = RecordingPolicy(spec.build(), spec)
    run = Simulation(cluster, rec, wl).run()
    return [(c.args[0], c.args[1]) for c in rec.calls if c.method == "decide"], run


def test_requests_and_views_carry_adapters() -> None:
    wl = load_workload("gen:lora?n=200&adapters=4&rate=20")
    seen, run = decisions(ClusterSpec(2, LORA), wl)
    assert {req.lora for req, _ in seen} == _lora_names(wl.requests)
    assert all(e.max_lora == 2 for _, view in seen for e in view)
    resident = [e.lora_resident for _, view in seen for e in view]
    assert any(resident) and all(len(r) <= 4 for r in resident)
    assert run.lora_loads is not None and run.lora_loads >= 4
    hidden, _ = decisions(ClusterSpec(2, LORA, adapter_view=False), wl)
    assert all(not e.lora_resident and e.max_lora == 0 for _, v in hidden for e in v)


def test_adapter_residency_in_the_view_cuts_loads() -> None:
    wl = load_workload("gen:lora?n=300&adapters=8&rate=6")
    seen = summarize(run_policy("least_loaded", wl, ClusterSpec(4, LORA)))
    blind = summarize(run_policy("least_loaded", wl, ClusterSpec(4, LORA, adapter_view=False)))
    assert seen["lora_loads"] < 0.7 * blind["lora_loads"]
    assert seen["ttft_p99"] < blind["ttft_p99"]


def test_base_traffic_results_do_not_move_with_lora_parameters() -> None:
    wl = load_workload("gen:tool_use?n=150&rate=10", WorkloadOptions())
    plain = summarize(run_policy("cache_aware", wl, ClusterSpec(3, SMALL)))
    other: PerfModel = SMALL.with_overrides(max_loras=1, lora_load_s=5.0)
    tuned = summarize(run_policy("cache_aware", wl, ClusterSpec(3, other)))
    assert "lora_loads" not in plain
    strip = {"policies": {"p": plain}}, {"policies": {"p": tuned}}
    assert deterministic_view(strip[0]) == deterministic_view(strip[1])


def test_the_pooled_bound_has_every_engines_adapter_slots() -> None:
    pooled = pooled_perf(LORA.with_overrides(max_cpu_loras=3), 4)
    assert (pooled.max_loras, pooled.max_cpu_loras) == (8, 12)
    assert pooled.lora_load_s == pytest.approx(0.05)
