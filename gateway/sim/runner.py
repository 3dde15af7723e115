"""Run several policies over one workload, optionally searching each one's capacity."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

from gateway.policies.base import PolicyContext
from gateway.policies.registry import create_policy
from gateway.sim.early_stop import EarlyStopSimulation, MissBudget, ProbeFailed
from gateway.sim.loop import ClusterSpec, SimRun, Simulation
from gateway.sim.metrics import cache_hit_upper_bound, slo_attainment, summarize
from gateway.sim.workloads import Workload

Progress = Callable[[str], None]

CAPACITY_TARGET = 0.9
"""Effective request capacity: the highest rate at which this share of requests meets its SLO."""

CAPACITY_TOLERANCE = 0.02
"""Capacity searches stop when the passing and failing rates are within 2 %."""


@dataclass(frozen=True, slots=True)
class SimulateOptions:
    policies: Sequence[str]
    cluster: ClusterSpec
    seed: int = 0
    capacity: bool = False
    capacity_target: float = CAPACITY_TARGET
    capacity_steps: int | None = None
    """Cap on bisection steps (None: bisect until ``capacity_tolerance``)."""
    capacity_tolerance: float = CAPACITY_TOLERANCE
    policy_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(slots=True)
class SimulateResult:
    """``results`` is the JSON document; ``runs`` keep per-request data for plots."""

    results: dict[str, Any]
    runs: dict[str, SimRun]


def run_policy(
    name: str,
    workload: Workload,
    cluster: ClusterSpec,
    *,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
    timer: Callable[[], float] | None = None,
    budget: MissBudget | None = None,
) -> SimRun:
    """One simulation of policy ``name`` with a fresh policy object.

    With a ``budget`` the run raises :class:`~gateway.sim.early_stop.ProbeFailed` as
    soon as too many requests certainly missed their SLO (capacity probes only).
    """
    ctx = PolicyContext(seed=seed, block_size=workload.block_size, perf=cluster.perf, pd=cluster.pd)
    policy = create_policy(name, ctx, options)
    if budget is not None:
        return EarlyStopSimulation(cluster, policy, workload, timer=timer, budget=budget).run()
    return Simulation(cluster, policy, workload, timer=timer).run()


class CapacityOptions(TypedDict, total=False):
    """The capacity search's knobs, passed through by keyword to :func:`workload_capacity`."""

    target: float
    steps: int | None
    tolerance: float
    first: SimRun | None
    ttft_only: bool
    bracket: float
    early_stop: bool
    cap: float
    floor: float


def capacity_search(
    name: str,
    workload: Workload,
    cluster: ClusterSpec,
    *,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
    **search: Unpack[CapacityOptions],
) -> tuple[float, int]:
    """Highest arrival rate (req/s) with SLO attainment >= ``target``, and runs used.

    Scales the workload's arrival times (see :func:`search_rate`: bracket by
    ``bracket``-fold steps from 1x, then bisect until the bracket is within
    ``tolerance``). ``ttft_only`` counts the TTFT target alone (DualMap's
    criterion); otherwise both TTFT and TPOT. ``early_stop``: a probe stops as
    soon as it has certainly failed (:mod:`gateway.sim.early_stop`; same answer).
    The knobs and their defaults: :func:`workload_capacity`.
    """
    return workload_capacity(
        workload,
        lambda wl, b: run_policy(name, wl, cluster, seed=seed, options=options, budget=b),
        **search,
    )


def workload_capacity(
    workload: Workload,
    simulate: Callable[[Workload, MissBudget | None], SimRun],
    *,
    target: float = CAPACITY_TARGET,
    steps: int | None = None,
    tolerance: float = CAPACITY_TOLERANCE,
    first: SimRun | None = None,
    ttft_only: bool = False,
    bracket: float = 2.0,
    early_stop: bool = True,
    cap: float = 64.0,
    floor: float = 1 / 64,
) -> tuple[float, int]:
    """The capacity search of policies and bounds alike: :func:`search_rate` over
    ``workload`` scaled in time, each probe ``simulate(scaled, budget)`` (see
    :func:`probe_attainment`); ``first``, when given, is the 1x run. (req/s, runs)."""

    def attainment(factor: float) -> float:
        if factor == 1.0 and first is not None:
            return slo_attainment(first, ttft_only=ttft_only)
        scaled = workload.scaled(factor)
        return probe_attainment(
            lambda b: simulate(scaled, b),
            len(workload),
            target,
            ttft_only=ttft_only,
            early_stop=early_stop,
        )

    return search_rate(
        workload.rate,
        attainment,
        target,
        tolerance=tolerance,
        max_steps=steps,
        free_first=first is not None,
        bracket=bracket,
        cap=cap,
        floor=floor,
    )


def probe_attainment(
    run: Callable[[MissBudget | None], SimRun],
    n: int,
    target: float,
    *,
    ttft_only: bool = False,
    early_stop: bool = True,
) -> float:
    """SLO attainment of ``run(budget)``; 0.0 when an early-stopped probe certainly failed."""
    if not early_stop:
        return slo_attainment(run(None), ttft_only=ttft_only)
    try:
        done = run(MissBudget(n, target, ttft_only=ttft_only))
    except ProbeFailed:
        return 0.0
    return slo_attainment(done, ttft_only=ttft_only)


def search_rate(
    base: float,
    attainment: Callable[[float], float],
    target: float,
    *,
    tolerance: float = CAPACITY_TOLERANCE,
    max_steps: int | None = None,
    free_first: bool = False,
    bracket: float = 2.0,
    cap: float = 64.0,
    floor: float = 1 / 64,
) -> tuple[float, int]:
    """The capacity search shared by policies and the bounds: the highest rate factor
    whose ``attainment`` meets ``target``, times ``base``, and the simulations it took.

    1. Bracket: from 1x, multiply by ``bracket`` (default 2) while the factor passes
       (up to ``cap``, default 64x: the highest factor tried is then returned) or
       divide while it fails (down to ``floor``, 1/64x: (0.0, runs) then). Start near
       the answer with a small ``bracket`` (say 1.25) to save probes.
    2. Bisect the bracket ``lo`` (passes) .. ``hi`` (fails) until ``hi / lo <= 1 +
       tolerance`` (or after ``max_steps`` bisections, when given), and return
       ``lo``: a rate that was seen to pass, at most ``tolerance`` below the
       first failing rate above it. From a factor-2 bracket, ±2 % takes 6 steps.

    Attainment need not be monotone in the rate (a loaded simulation is noisy):
    the invariant "lo passed, hi failed" holds anyway, so the answer is always a
    measured passing rate next to a measured failing one. ``free_first``: the
    1x run is already known and not counted.
    """
    if tolerance <= 0:
        raise ValueError(f"tolerance must be positive, got {tolerance}")
    if bracket <= 1:
        raise ValueError(f"bracket must be > 1, got {bracket}")
    runs = 0

    def ok(factor: float) -> bool:
        nonlocal runs
        if not (factor == 1.0 and free_first):
            runs += 1
        return attainment(factor) >= target

    if base <= 0:
        return 0.0, runs
    lo, hi = 1.0, bracket
    if ok(1.0):
        while ok(hi):
            lo, hi = hi, hi * bracket
            if hi > cap:
                return base * lo, runs
    else:
        hi, lo = 1.0, 1.0 / bracket
        while not ok(lo):
            hi, lo = lo, lo / bracket
            if lo < floor:
                return 0.0, runs
    steps = 0
    while hi > lo * (1.0 + tolerance) and (max_steps is None or steps < max_steps):
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
        steps += 1
    return base * lo, runs


def simulate(
    workload: Workload,
    opts: SimulateOptions,
    *,
    progress: Progress | None = None,
    timer: Callable[[], float] | None = None,
    preset_name: str | None = None,
) -> SimulateResult:
    """Run every policy in ``opts`` and assemble ``results.json``."""
    say = progress or (lambda _msg: None)
    cluster = opts.cluster
    reason = _admission_checker(cluster)
    results: dict[str, Any] = {
        "workload": workload.name,
        "instances": cluster.instances,
        "preset": preset_name or cluster.perf.name,
        "seed": opts.seed,
        "requests": len(workload),
        "block_size": workload.block_size,
        "rate_rps": workload.rate,
        "cache_hit_upper_bound": cache_hit_upper_bound(
            workload, lambda r: reason(r.prompt_tokens, r.output_tokens) is None
        ),
        "policies": {},
    }
    runs: dict[str, SimRun] = {}
    total = len(opts.policies)
    for i, name in enumerate(opts.policies, start=1):
        options = opts.policy_options.get(name)
        run = run_policy(name, workload, cluster, seed=opts.seed, options=options, timer=timer)
        summary = summarize(run)
        if opts.capacity:
            cap, probes = capacity_search(
                name,
                workload,
                cluster,
                seed=opts.seed,
                options=options,
                target=opts.capacity_target,
                steps=opts.capacity_steps,
                tolerance=opts.capacity_tolerance,
                first=run,
            )
            summary["capacity_rps"] = cap
            summary["capacity_runs"] = probes
        runs[name] = run
        results["policies"][name] = summary
        say(_progress_line(i, total, name, summary))
    return SimulateResult(results=results, runs=runs)


def _admission_checker(cluster: ClusterSpec) -> Callable[[int, int], str | None]:
    from gateway.perfmodel.engine import EngineCore

    probe = EngineCore("probe", cluster.perf)
    return probe.admissible


def _progress_line(i: int, total: int, name: str, s: Mapping[str, Any]) -> str:
    def fmt(v: Any, unit: str = "s") -> str:
        return "-" if v is None else f"{v:.3f}{unit}"

    line = (
        f"[{i}/{total}] {name}: {s['completed']}/{s['requests']} done, "
        f"hit {s['cache_hit_rate']:.1%}, TTFT p50 {fmt(s['ttft_p50'])} p99 {fmt(s['ttft_p99'])}, "
        f"goodput {s['goodput']:.1%}, load CV {s['load_cv_mean']:.2f}"
    )
    if s.get("capacity_rps") is not None:
        line += f", capacity {s['capacity_rps']:.2f} req/s"
    return line


def deterministic_view(results: Mapping[str, Any]) -> dict[str, Any]:
    """``results`` without the fields measured in real time (decision timing)."""
    out = dict(results)
    out["policies"] = {
        name: {k: v for k, v in pol.items() if not k.startswith("decision_us")}
        for name, pol in results["policies"].items()
    }
    return out
