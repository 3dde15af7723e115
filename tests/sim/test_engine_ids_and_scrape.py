"""ClusterSpec.engine_ids names the simulated engines; scrape_interval_s shows policies the
engines' own load numbers as a scraping gateway sees them (held between scrapes)."""

from __future__ import annotations

from pathlib import Path

from gateway.core.types import ClusterView
from gateway.policies.base import PolicyContext
from gateway.policies.recording import PolicySpec, RecordingPolicy
from gateway.sim.loop import ClusterSpec, Simulation
from gateway.sim.workloads import WorkloadOptions, load_workload
from tests.sim.test_loop import SMALL


def views(trace: Path, **spec: object) -> list[ClusterView]:
    workload = load_workload(f"mooncake:{trace}", WorkloadOptions(rate_scale=4.0))
    cluster = ClusterSpec(3, SMALL, **spec)  # type: ignore[arg-type]
    policy = PolicySpec.of("least_loaded", PolicyContext(perf=SMALL), None)
    rec = RecordingPolicy(policy.build(), policy)
    Simulation(cluster, rec, workload).run()
    return [c.args[1] for c in rec.calls if c.method == "decide"]


def test_engines_take_the_given_names(mooncake_trace: Path) -> None:
    names = ("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000")
    assert {v.ids for v in views(mooncake_trace, engine_ids=names)} == {names}
    assert views(mooncake_trace)[0].ids == ("sim-0", "sim-1", "sim-2")


def test_scraped_load_is_held_between_scrapes_the_routers_own_numbers_are_not(
    mooncake_trace: Path,
) -> None:
    exact = views(mooncake_trace)
    assert any(e.num_running for v in exact for e in v.engines)
    # one scrape, at the first decision (an idle cluster), for the whole run
    held = views(mooncake_trace, scrape_interval_s=1e9)
    assert not any(e.num_running or e.num_waiting or e.kv_usage for v in held for e in v.engines)
    # the router's own accounting stays exact
    assert any(e.in_flight for v in held for e in v.engines)
    assert any(e.pending_prefill_tokens for v in held for e in v.engines)
    # a short interval follows the engines again
    assert any(
        e.num_running for v in views(mooncake_trace, scrape_interval_s=0.5) for e in v.engines
    )
