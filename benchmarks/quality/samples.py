"""Capacity over many samples of one workload shape: is a suite cell's ratio the policy or the draw?

    python -m benchmarks.quality.samples SPEC --requests N --samples K [--preset P]
        [--instances 8] [--ttft-slo 5 --tpot-slo 0.1] [--scrape-interval 0]
        [--policies a,b:knob=v;knob=v,...] [--jobs 2]

A suite cell is one draw of 150-240 requests, where 15-24 misses decide the 90 % line
and capacities move by up to ±10 % with the search's start. This benchmark draws
``K`` samples of the same shape and runs the suite's search on each
(``benchmarks.quality.suite``: from 0.7x the sample's shared-queue capacity,
bracketing by 1.25x, to ±2 %):

* a generator spec with ``{seed}`` (``'gen:chat_burst?n=150&seed={seed}'``) draws
  sample ``k`` with seed ``k``;
* any other spec (a trace: ``mooncake:PATH``) is cut into consecutive windows of
  ``--requests`` requests, sample ``k`` the ``k``-th, at the trace's own rate.

It prints each sample's capacities, then per policy the geometric mean and the
lowest of its ratio to ``least_loaded`` and to the sample's best baseline (the
strongest of the baselines run), and in how many samples it is >= 0.97x of each
(ratios within ±0.03 are ties); and each policy's mean SLO attainment at 0.75x and
1x of every sample's shared-queue capacity, a common rate, steadier than a
capacity where the attainment curve runs flat along the 90 % line. The simulator
is deterministic: a rerun prints the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from benchmarks.common import benchmark_parser
from benchmarks.quality.diagnose import parse_policy
from benchmarks.quality.suite import BASELINES, POLICY_BRACKET, pool_map
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.sim.loop import ClusterSpec
from gateway.sim.metrics import slo_attainment
from gateway.sim.runner import capacity_search, run_policy
from gateway.sim.shared_queue import shared_queue_capacity
from gateway.sim.workloads import Workload, WorkloadOptions, builtin_slo_classes, load_workload

POLICIES = "predicted_ttft,least_loaded,cache_aware,kv_cost,weighted_scorer,preble,dualmap"
TIE = 0.97
"""A ratio at or above this counts as "not below" (the suite's ±0.03 ties)."""
STANDARD_SLO = (5.0, 0.1)
"""The standard SLO class's (TTFT, TPOT) targets in seconds unless ``--ttft-slo``/``--tpot-slo``."""
LOADS = (0.75, 1.0)
"""Attainment is also measured at these fractions of each sample's shared-queue capacity."""


def sample(spec: str, requests: int, k: int, slo: tuple[float, float] = STANDARD_SLO) -> Workload:
    """Sample ``k``: seed ``k`` of a ``{seed}`` spec, else the ``k``-th window of the trace;
    ``slo``: the standard class's (TTFT, TPOT) targets in seconds."""
    classes = builtin_slo_classes(*slo)
    if "{seed}" in spec:
        opts = WorkloadOptions(limit=requests, seed=k, slo_classes=classes)
        return load_workload(spec.format(seed=k), opts).head(requests)
    wl = load_workload(spec, WorkloadOptions(limit=requests * (k + 1), slo_classes=classes))
    window = wl.requests[requests * k : requests * (k + 1)]
    if len(window) < requests:
        raise SystemExit(f"{spec} has {len(wl)} requests: no window {k} of {requests}")
    t0 = window[0].arrival
    shifted = tuple(replace(r, arrival=r.arrival - t0) for r in window)
    return replace(wl, requests=shifted)


@dataclass(frozen=True)
class Job:
    spec: str
    requests: int
    k: int
    preset: str
    policies: tuple[str, ...]
    instances: int = 8
    slo: tuple[float, float] = STANDARD_SLO
    scrape_interval_s: float = 0.0


def run_sample(job: Job) -> tuple[int, dict[str, float]]:
    """One sample's capacities (req/s) per policy, searched as the suite does."""
    wl = sample(job.spec, job.requests, job.k, job.slo)
    cluster = ClusterSpec(
        job.instances, load_preset(job.preset), scrape_interval_s=job.scrape_interval_s
    )
    sq, _ = shared_queue_capacity(wl, cluster)
    start = wl.scaled(0.7 * sq / wl.rate) if sq > 0 else wl
    caps: dict[str, float] = {"shared_queue": sq}
    for text in job.policies:
        name, opts = parse_policy(text)
        caps[text], _ = capacity_search(name, start, cluster, options=opts, bracket=POLICY_BRACKET)
        for load in LOADS:  # no common rate where not even the bound meets the SLO
            if sq <= 0:
                caps[f"{text}@{load:g}"] = math.nan
                continue
            run = run_policy(name, wl.scaled(load * sq / wl.rate), cluster, options=opts)
            caps[f"{text}@{load:g}"] = slo_attainment(run)
    return job.k, caps


def ratios(caps: Mapping[int, Mapping[str, float]], policy: str, against: str) -> list[float]:
    """``policy``'s capacity ÷ ``against``'s per sample; ``against="best"``: the sample's
    strongest baseline (of those run). A sample where the reference's capacity is 0 (no
    rate meets the SLO) has no ratio and is left out."""
    out = []
    for row in caps.values():
        if against == "best":
            den = max((row[b] for b in BASELINES if b in row), default=0.0)
        else:
            den = row[against]
        if den > 0:
            out.append(row[policy] / den)
    return out


def geomean(values: Sequence[float]) -> float:
    finite = [v for v in values if 0 < v < math.inf]
    return math.exp(sum(map(math.log, finite)) / len(finite)) if finite else math.nan


def render(caps: Mapping[int, Mapping[str, float]], policies: Sequence[str]) -> str:
    keys = sorted(caps)
    lines = ["| sample | " + " | ".join([*policies, "SQ bound"]) + " |"]
    lines.append("|---" * (len(policies) + 2) + "|")
    for k in keys:
        row = caps[k]
        cells = [f"{row[p]:.2f}" for p in [*policies, "shared_queue"]]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    head = "| policy | ÷ least_loaded: geomean / lowest / ≥ 0.97 | ÷ best baseline: geomean / "
    head += "lowest / ≥ 0.97 | " + " | ".join(f"attainment at {x:g}× SQ (mean)" for x in LOADS)
    lines += ["", head + " |", "|---" * (3 + len(LOADS)) + "|"]
    known = any(b in row for row in caps.values() for b in BASELINES)  # a baseline was run
    for p in policies:
        parts = []
        for against in ("least_loaded", "best"):
            if (against == "least_loaded" and against not in policies) or not known:
                parts.append("—")
                continue
            r = ratios(caps, p, against)
            if not r:
                parts.append("—")
                continue
            ok = sum(1 for v in r if v >= TIE)
            parts.append(f"{geomean(r):.2f} / {min(r):.2f} / {ok} of {len(r)}")
        for x in LOADS:
            att = [row[f"{p}@{x:g}"] for row in caps.values() if row["shared_queue"] > 0]
            parts.append(f"{sum(att) / len(att):.1%}" if att else "—")
        lines.append(f"| {p} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = benchmark_parser(__doc__, "benchmarks.quality.samples")
    ap.add_argument("spec")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--preset", default=DEFAULT_PRESET)
    ap.add_argument("--instances", type=int, default=8, help="engines in the pool (default 8)")
    ap.add_argument("--ttft-slo", type=float, default=STANDARD_SLO[0], help="TTFT target, s")
    ap.add_argument("--tpot-slo", type=float, default=STANDARD_SLO[1], help="TPOT target, s")
    ap.add_argument(
        "--scrape-interval",
        type=float,
        default=0.0,
        help="policies see engine-reported load as scraped every this many seconds (0: exact)",
    )
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    policies = tuple(p for p in args.policies.split(",") if p)
    slo, scrape = (args.ttft_slo, args.tpot_slo), args.scrape_interval
    jobs = [
        Job(args.spec, args.requests, k, args.preset, policies, args.instances, slo, scrape)
        for k in range(args.samples)
    ]
    caps = dict(pool_map(run_sample, jobs, args.jobs))
    pool = f"{args.instances} × {args.preset}, SLO {args.ttft_slo:g} s / {args.tpot_slo:g} s"
    if scrape:
        pool += f", load scraped every {scrape:g} s"
    print(f"{args.spec}: {args.samples} samples of {args.requests} requests, {pool}")
    print(render(caps, policies))
    idle = sorted(k for k, row in caps.items() if row["shared_queue"] <= 0)
    if idle:
        print(f"\nSamples {idle}: not even the shared-queue bound meets the SLO at any rate;")
        print("they are left out of the ratios and attainment means.")


if __name__ == "__main__":
    main()
