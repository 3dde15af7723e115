"""Capacity planning: the smallest pool per policy that meets an SLO attainment target.

For each policy, :func:`plan` searches the smallest number of engines N at
which at least ``target`` of the workload's requests meet their SLO (both the
TTFT and the TPOT target of their class). Attainment is roughly monotone in
N, so the search brackets from a starting guess by doubling (or halving), then
bisects: about 2·log2(N) simulations instead of N. The answer it returns has
been simulated to meet the target at N and to miss it at N−1 (or N = 1); it is
the smallest pool when attainment is monotone, which it need not be exactly
(a hash ring remaps keys when it grows, preemption thresholds shift), so a
smaller pool that happens to pass may exist below a failing one.

The pooled bound (:mod:`gateway.sim.bound`) is searched first; its pool size
seeds every policy's search. With ``pd``, policies that place both legs
themselves (``cost_model``, ``length_heuristic``) are also searched on
disaggregated pools: for each N, a hill climb over the number of prefill
engines K (attainment is roughly unimodal in K: too few prefill engines miss
TTFT, too few decode engines miss TPOT), stopping as soon as a split meets the
target.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.perfmodel.model import PerfModel
from gateway.sim.bound import BOUND_NAME, run_bound
from gateway.sim.loop import ClusterSpec, SimRun
from gateway.sim.metrics import slo_attainment, summarize
from gateway.sim.runner import run_policy
from gateway.sim.workloads import Workload

Progress = Callable[[str], None]
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class PlanOptions:
    policies: Sequence[str]
    perf: PerfModel
    target: float = 0.9
    max_instances: int = 64
    pd: Sequence[str] = ()
    """Policies to search on disaggregated pools as well (their rows get a ``/pd`` suffix)."""
    seed: int = 0
    priority_groups: bool = False
    kv_bandwidth_gbps: float = 25.0
    policy_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Probe:
    """One simulation of the search: pool size, prefill engines (0: unified), attainment."""

    instances: int
    prefill: int
    attainment: float
    seconds: float
    summary: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "instances": self.instances,
            "prefill_instances": self.prefill,
            "attainment": self.attainment,
            "seconds": self.seconds,
        }


@dataclass(slots=True)
class PlanRow:
    """One policy's (or the bound's) search: the answer and every simulation it took."""

    label: str
    policy: str
    disaggregated: bool
    best: Probe | None = None
    probes: list[Probe] = field(default_factory=list)
    by_size: dict[int, Probe] = field(default_factory=dict)
    """P/D rows: the best split found for each pool size."""

    @property
    def pool(self) -> int | None:
        return None if self.best is None else self.best.instances

    def to_json(self, bound_pool: int | None) -> dict[str, Any]:
        best = self.best
        s: Mapping[str, Any] = best.summary if best else {}
        return {
            "policy": self.policy,
            "disaggregated": self.disaggregated,
            "pool": self.pool,
            "prefill_instances": best.prefill if best and best.prefill else None,
            "attainment": best.attainment if best else None,
            "ttft_p50": s.get("ttft_p50"),
            "ttft_p99": s.get("ttft_p99"),
            "cache_hit_rate": s.get("cache_hit_rate"),
            "bound_fraction": (bound_pool / self.pool) if bound_pool and self.pool else None,
            "simulations": len(self.probes),
            "probes": [p.to_json() for p in sorted(self.probes, key=_probe_key)],
        }


@dataclass(slots=True)
class PlanResult:
    bound: PlanRow
    rows: list[PlanRow]
    recommended: str | None

    def to_json(self) -> dict[str, Any]:
        bound_pool = self.bound.pool
        return {
            "bound": self.bound.to_json(bound_pool),
            "policies": {r.label: r.to_json(bound_pool) for r in self.rows},
            "recommended": self.recommended,
        }


def _probe_key(p: Probe) -> tuple[int, int]:
    return (p.instances, p.prefill)


def smallest_passing(
    passes: Callable[[int], bool], start: int, lo: int = 1, hi: int = 64
) -> int | None:
    """The smallest n in [lo, hi] with ``passes(n)``, assuming it is monotone in n.

    Brackets from ``start`` by doubling up (while failing) or halving down (while
    passing), then bisects. ``None`` when even ``hi`` fails.
    """
    if lo > hi:
        return None
    n = min(max(start, lo), hi)
    if passes(n):
        good = n
        while good > lo:
            low = max(lo, good // 2)
            if not passes(low):
                bad = low
                break
            good = low
        else:
            return good
    else:
        bad = n
        while True:
            if bad >= hi:
                return None
            up = min(hi, bad * 2)
            if passes(up):
                good = up
                break
            bad = up
    while good - bad > 1:
        mid = (good + bad) // 2
        if passes(mid):
            good = mid
        else:
            bad = mid
    return good


class Planner:
    """Runs the searches of one :func:`plan` call, memoising every simulation."""

    def __init__(
        self, workload: Workload, opts: PlanOptions, say: Progress, clock: Clock | None
    ) -> None:
        self.workload = workload
        self.opts = opts
        self.say = say
        self.clock = clock

    def _cluster(self, n: int, k: int) -> ClusterSpec:
        o = self.opts
        return ClusterSpec(
            n,
            o.perf,
            priority_groups=o.priority_groups,
            prefill_instances=k,
            kv_bandwidth_gbps=o.kv_bandwidth_gbps,
        )

    def probe(self, row: PlanRow, n: int, k: int = 0) -> Probe:
        for p in row.probes:
            if (p.instances, p.prefill) == (n, k):
                return p
        t0 = self.clock() if self.clock else 0.0
        cluster = self._cluster(n, k)
        run: SimRun
        if row.policy == BOUND_NAME:
            run = run_bound(self.workload, cluster, seed=self.opts.seed)
        else:
            options = self.opts.policy_options.get(row.policy)
            run = run_policy(
                row.policy, self.workload, cluster, seed=self.opts.seed, options=options
            )
        got = slo_attainment(run)
        secs = (self.clock() - t0) if self.clock else 0.0
        p = Probe(n, k, got, secs, summarize(run))
        row.probes.append(p)
        split = f" ({k}P+{n - k}D)" if k else ""
        mark = "meets" if got >= self.opts.target else "misses"
        self.say(
            f"[plan] {row.label}: {n} engines{split}: attainment {got:.1%} ({mark} "
            f"{self.opts.target:.0%}), {secs:.1f} s"
        )
        return p

    def best_split(self, row: PlanRow, n: int) -> Probe:
        """Hill-climb the prefill count K in [1, n-1]; stop early once the target is met."""
        if n in row.by_size:
            return row.by_size[n]
        target = self.opts.target
        near = min(row.by_size.values(), key=lambda p: abs(p.instances - n), default=None)
        ratio = near.prefill / near.instances if near else 0.5
        k = min(n - 1, max(1, round(n * ratio)))
        cur = self.probe(row, n, k)
        while cur.attainment < target:
            around = [self.probe(row, n, j) for j in (k - 1, k + 1) if 1 <= j <= n - 1]
            better = max(around, key=lambda p: p.attainment, default=None)
            if better is None or better.attainment <= cur.attainment:
                break
            step = better.prefill - k
            cur, k = better, better.prefill
            while cur.attainment < target and 1 <= k + step <= n - 1:
                nxt = self.probe(row, n, k + step)
                if nxt.attainment <= cur.attainment:
                    break
                cur, k = nxt, k + step
        row.by_size[n] = cur
        return cur

    def attain(self, row: PlanRow, n: int) -> Probe:
        return self.best_split(row, n) if row.disaggregated else self.probe(row, n)

    def search(self, row: PlanRow, start: int) -> PlanRow:
        target = self.opts.target
        lo = 2 if row.disaggregated else 1
        found = smallest_passing(
            lambda n: self.attain(row, n).attainment >= target,
            start,
            lo=lo,
            hi=self.opts.max_instances,
        )
        if found is not None:
            row.best = self.attain(row, found)
        return row


def plan(
    workload: Workload,
    opts: PlanOptions,
    *,
    progress: Progress | None = None,
    clock: Clock | None = None,
) -> PlanResult:
    """Search the pooled bound's pool size, then each policy's; recommend the smallest."""
    planner = Planner(workload, opts, progress or (lambda _m: None), clock)
    bound = planner.search(PlanRow("pooled bound", BOUND_NAME, False), _first_guess(workload, opts))
    start = bound.pool or opts.max_instances
    rows = [planner.search(PlanRow(name, name, False), start) for name in opts.policies]
    rows += [planner.search(PlanRow(f"{name}/pd", name, True), max(2, start)) for name in opts.pd]
    return PlanResult(bound=bound, rows=rows, recommended=recommend(rows))


def recommend(rows: Sequence[PlanRow]) -> str | None:
    """Smallest pool; ties by higher attainment there, then lower TTFT p99."""
    found = [r for r in rows if r.best is not None]
    if not found:
        return None

    def key(r: PlanRow) -> tuple[int, float, float]:
        assert r.best is not None
        p99 = r.best.summary.get("ttft_p99")
        return (r.best.instances, -r.best.attainment, math.inf if p99 is None else p99)

    return min(found, key=key).label


def _first_guess(workload: Workload, opts: PlanOptions) -> int:
    """Engines needed just to keep up with the prompt tokens at one batch per step."""
    perf = opts.perf
    budget = perf.max_num_batched_tokens
    per_token = perf.step_time([(budget, 0)], 0, 0) / budget
    span = workload.span
    if span <= 0:
        return 1
    tokens = sum(r.prompt_tokens for r in workload.requests)
    need = tokens * per_token / span
    return max(1, min(opts.max_instances, math.ceil(need)))
