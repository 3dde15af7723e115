"""The pooled bound: the workload on ONE engine with N engines' worth of compute and KV.

N engines behind a router can at best behave like one big engine that owns all
their compute and all their KV blocks as one global prefix cache: no request
ever misses a prefix because it was sent to the wrong engine (perfect reuse),
and no engine idles while another has a queue (perfect balance). The bound
builds that engine from the cluster's :class:`PerfModel` and simulates the
same workload on it alone.

Construction (``pooled_perf``), for a cluster of N engines:

* every timing coefficient is divided by N — prefill ``a, b, c, d`` and decode
  ``e0, e1, e2`` — so any step takes 1/N of the time it takes one engine;
* the per-step token budget (``max_num_batched_tokens``), the sequence slots
  (``max_num_seqs``) and the KV blocks (``kv_capacity_blocks``) are multiplied
  by N; ``max_model_len``, the block size and KV bytes per token stay. LoRA:
  the adapter slots and CPU cache (``max_loras``, ``max_cpu_loras``) are
  multiplied by N, the adapter load times divided by N.

A step over the union of what N engines compute in one step each (at most N·B
tokens) costs at most the longest of their steps (``max(a, e0)/N`` plus the
variable parts / N, which sum to at most N times the largest), so the pooled
engine keeps up with any routing of the same work over N engines; on top of
that every request meets one global cache with N engines' worth of blocks
(perfect reuse) and no capacity idles while a queue waits (perfect balance).
A lone request is N times faster than on any engine, so at light load the
bound is loose by up to N on latency; that is the price of a bound.

Two alternatives were tried and rejected. Keeping the per-step overheads
``a`` and ``e0`` (dividing only the per-token costs) makes every arrival wait
for, and then share, a step that costs ``max(a, e0)`` as on one engine, while a
cluster at light load has idle engines: policies then beat it on TTFT mean and
p50. Keeping the token budget (dividing every time, N× faster steps of B
tokens) is loose wherever TPOT matters: its steps are N times shorter than any
engine's, so its TPOT and TPOT-bound capacity are far beyond reach.

It is a bound *in the sense of the model*, not a theorem about every metric.
Claimed: TTFT mean and p50, never beaten by any policy in the property tests
(``tests/sim/test_bound.py``) or in a wider sweep. Not claimed:

* TPOT is not bounded: a disaggregated cluster keeps decodes on engines that
  prefill nothing; the pooled engine batches every decode with every prefill.
* Tail latency (TTFT p99) and SLO attainment under overload are not bounded:
  the pooled engine serves one FCFS queue, which spreads a backlog evenly over
  everyone, while a router that keeps short requests away from long prefills
  acts like a priority scheduler and can keep more requests within a deadline;
  so SLO capacity can exceed the bound's by a few percent on bursty workloads.
* The hit rate can exceed the bound's by up to ~2 points: one large
  step admits two requests sharing a prefix not computed yet, and both compute
  it (vLLM does not wait for an in-flight prefix), where a busier engine would
  have queued the second until the prefix was cached.
  ``cache_hit_upper_bound`` (an infinite cache in the best order) is the hard
  limit on the hit rate.

Requests that no single engine could hold (longer than ``max_model_len`` or one
engine's KV) are rejected by the bound too, as the cluster rejects them.
``docs/simulator.md`` shows the evidence and how to read *fraction of the bound*.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Unpack

from gateway.core.types import RequestInfo
from gateway.perfmodel.engine import EngineCore
from gateway.perfmodel.model import PerfModel
from gateway.sim.early_stop import MissBudget
from gateway.sim.loop import ClusterSpec, RequestRecord, SimRun
from gateway.sim.metrics import slo_attainment, summarize
from gateway.sim.runner import (
    CAPACITY_TARGET,
    CAPACITY_TOLERANCE,
    CapacityOptions,
    run_policy,
    workload_capacity,
)
from gateway.sim.workloads import Workload

BOUND_NAME = "pooled_bound"
"""The bound's key in ``results.json`` and its row label in reports."""

_TIMES = (
    *("prefill_a", "prefill_b", "prefill_c", "prefill_d", "decode_e0", "decode_e1", "decode_e2"),
    *("lora_load_s", "lora_activate_s"),
)
_TIMES_N = (
    *("max_num_batched_tokens", "max_num_seqs", "kv_capacity_blocks"),
    *("max_loras", "max_cpu_loras"),
)


def pooled_perf(perf: PerfModel, n: int) -> PerfModel:
    """One engine ``n`` times as fast, with the batch budget, slots and KV of ``n`` engines."""
    if n <= 0:
        raise ValueError("the pooled bound needs a positive number of engines")
    changes: dict[str, Any] = {k: getattr(perf, k) / n for k in _TIMES}
    changes.update({k: getattr(perf, k) * n for k in _TIMES_N})
    return perf.with_overrides(name=f"{perf.name} pooled x{n}", **changes)


def pooled_cluster(cluster: ClusterSpec) -> ClusterSpec:
    """The single pooled engine standing for ``cluster`` (its largest size, unified)."""
    n = cluster.max_instances
    return ClusterSpec(
        instances=1,
        perf=pooled_perf(cluster.perf, n),
        priority_groups=cluster.priority_groups,
        max_decode_run=cluster.max_decode_run,
    )


def run_bound(
    workload: Workload, cluster: ClusterSpec, *, seed: int = 0, budget: MissBudget | None = None
) -> SimRun:
    """Simulate ``workload`` on the pooled engine of ``cluster``.

    Requests that one engine of the cluster could never hold are recorded as
    rejected (they would be rejected by the cluster too), the rest are served.
    ``budget``: a capacity probe that stops once it certainly failed.
    """
    probe = EngineCore("probe", cluster.perf)
    served = []
    rejected: dict[str, str] = {}
    for req in workload.requests:
        reason = probe.admissible(req.prompt_tokens, req.output_tokens)
        if reason is None:
            served.append(req)
        else:
            rejected[req.id] = reason
    kept = replace(workload, requests=tuple(served)) if rejected else workload
    if budget is not None:
        budget.add_misses(len(rejected))
    run = (
        run_policy("round_robin", kept, pooled_cluster(cluster), seed=seed, budget=budget)
        if served
        else SimRun(policy="round_robin", records=[])
    )
    run.policy = BOUND_NAME
    if rejected:
        by_id = {r.source.id: r for r in run.records}
        records = []
        for req in workload.requests:
            record = by_id.get(req.id)
            if record is None:
                info = RequestInfo(
                    id=req.id,
                    block_hashes=req.block_hashes,
                    prompt_tokens=req.prompt_tokens,
                    arrival=req.arrival,
                    block_size=workload.block_size,
                    slo=req.slo,
                )
                record = RequestRecord(source=req, info=info, rejected=rejected[req.id])
            records.append(record)
        run.records = records
    return run


def bound_attainment(
    workload: Workload, cluster: ClusterSpec, *, seed: int = 0, ttft_only: bool = False
) -> tuple[float, SimRun]:
    """SLO attainment of the pooled bound on ``workload`` (and its run)."""
    run = run_bound(workload, cluster, seed=seed)
    return slo_attainment(run, ttft_only=ttft_only), run


def bound_capacity(
    workload: Workload,
    cluster: ClusterSpec,
    *,
    seed: int = 0,
    **search: Unpack[CapacityOptions],
) -> tuple[float, int]:
    """The pooled bound's capacity, searched exactly as ``runner.capacity_search`` does
    (the same bracket, cap, floor and tolerance), so that policy / bound ratios compare
    like with like. Returns (req/s, simulations run).
    """
    return workload_capacity(
        workload, lambda wl, b: run_bound(wl, cluster, seed=seed, budget=b), **search
    )


def bound_summary(run: SimRun, cluster: ClusterSpec) -> dict[str, Any]:
    """The bound's entry of ``results.json``: the usual summary plus what it stands for."""
    out = summarize(run)
    out["engines_pooled"] = cluster.max_instances
    out["construction"] = (
        f"one engine {cluster.max_instances}x as fast (every step time / "
        f"{cluster.max_instances}) with {cluster.max_instances}x the token budget, sequence "
        "slots and KV blocks: one global prefix cache, one queue"
    )
    return out


def _ratio(num: Any, den: Any) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return float(num) / float(den)


def fraction_of_bound(policy: Mapping[str, Any], bound: Mapping[str, Any]) -> dict[str, Any]:
    """How close a policy comes to the bound: 1.0 = as good as the bound, lower = worse.

    Latencies are bound / policy (a policy twice as slow scores 0.5); the hit rate
    and the capacity are policy / bound.
    """
    return {
        "ttft_mean": _ratio(bound.get("ttft_mean"), policy.get("ttft_mean")),
        "ttft_p50": _ratio(bound.get("ttft_p50"), policy.get("ttft_p50")),
        "cache_hit_rate": _ratio(policy.get("cache_hit_rate"), bound.get("cache_hit_rate")),
        "capacity_rps": _ratio(policy.get("capacity_rps"), bound.get("capacity_rps")),
    }


def attach_bound(
    results: dict[str, Any],
    workload: Workload,
    cluster: ClusterSpec,
    *,
    seed: int = 0,
    capacity: bool = False,
    target: float = CAPACITY_TARGET,
    steps: int | None = None,
    tolerance: float = CAPACITY_TOLERANCE,
    shared_queue: bool = True,
) -> SimRun:
    """Add ``pooled_bound`` and each policy's ``vs_bound`` to a ``simulate`` results document,
    and (``shared_queue``) the tighter ``shared_queue_bound`` with each ``vs_shared_queue``
    (see :mod:`gateway.sim.shared_queue`).

    The bounds' capacities are searched (as the policies' are) only with ``capacity``.
    Returns the pooled bound's run (for plots).
    """
    run = run_bound(workload, cluster, seed=seed)
    bound = bound_summary(run, cluster)
    if capacity:
        cap, probes = bound_capacity(
            workload, cluster, seed=seed, target=target, steps=steps, tolerance=tolerance, first=run
        )
        bound["capacity_rps"] = cap
        bound["capacity_runs"] = probes
    results["pooled_bound"] = bound
    for pol in results["policies"].values():
        pol["vs_bound"] = fraction_of_bound(pol, bound)
    if shared_queue:
        from gateway.sim.shared_queue import attach_shared_queue  # it imports this module

        attach_shared_queue(
            results,
            workload,
            cluster,
            capacity=capacity,
            target=target,
            steps=steps,
            tolerance=tolerance,
        )
    return run
