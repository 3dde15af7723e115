"""Small checks printed into docs/simulator.md: workload statistics and policies below the bounds.

python -m benchmarks.quality.evaluate workload-stats [SPEC ...]
python -m benchmarks.quality.evaluate bound-check [SPEC:ENGINES ...]
"""

from __future__ import annotations

from benchmarks.common import benchmark_parser
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.policies.registry import policy_names
from gateway.sim.bound import run_bound
from gateway.sim.loop import ClusterSpec
from gateway.sim.metrics import cache_hit_upper_bound, summarize
from gateway.sim.runner import run_policy
from gateway.sim.shared_queue import run_shared_queue
from gateway.sim.workloads import WorkloadOptions, load_workload


def workload_stats(argv: list[str]) -> int:
    """``workload-stats [SPEC ...]``: the statistics docs/simulator.md compares with the traces."""
    from statistics import fmean

    from gateway.sim.metrics import percentile

    ap = benchmark_parser(workload_stats.__doc__, "benchmarks.quality.evaluate workload-stats")
    ap.add_argument("specs", nargs="*", metavar="SPEC", help="simulator workload specs")
    specs = ap.parse_args(argv).specs or [
        "gen:chat?n=1500",
        "gen:chat?n=1500&seed=1",
        "gen:chat?n=12031",
        "gen:agent?n=1500",
        "gen:agent?n=1500&seed=1",
        "gen:agent?n=8000",
    ]
    print(
        "| spec | requests | req/s | input mean | p50 | p99 | output mean | continue | reusable |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for spec in specs:
        wl = load_workload(spec, WorkloadOptions())
        prompts = [r.prompt_tokens for r in wl.requests]
        sessions = {r.session or r.id for r in wl.requests}
        print(
            f"| `{spec}` | {len(wl):,} | {wl.rate:.2f} | {fmean(prompts):,.0f} | "
            f"{percentile(prompts, 50):,.0f} | {percentile(prompts, 99):,.0f} | "
            f"{fmean(r.output_tokens for r in wl.requests):.0f} | "
            f"{1 - len(sessions) / len(wl):.0%} | {cache_hit_upper_bound(wl):.1%} |"
        )
    return 0


def bound_check(argv: list[str]) -> int:
    """``bound-check [SPEC:ENGINES ...]``: TTFT mean / p50 of both bounds and of
    every policy that beats one of them (docs/simulator.md, the shared-queue bound)."""
    ap = benchmark_parser(bound_check.__doc__, "benchmarks.quality.evaluate bound-check")
    ap.add_argument("cases", nargs="*", metavar="SPEC:ENGINES", help="a workload and its engines")
    cases = ap.parse_args(argv).cases
    perf = load_preset(DEFAULT_PRESET)
    cases = cases or [
        "gen:tool_use?n=160&rate=12&arrival=gamma&cv=3:2",
        "gen:tool_use?n=160&rate=9&arrival=gamma&cv=3:2",
        "gen:chat?n=200&rate=4:4",
        "gen:no_sharing?n=200&rate=8:4",
    ]
    print("| workload | engines | SQ TTFT mean / p50 | pooled | policies below the SQ bound |")
    print("|---|---:|---:|---:|---|")
    for case in cases:
        spec, _, engines = case.rpartition(":")
        wl = load_workload(spec, WorkloadOptions())
        cluster = ClusterSpec(int(engines), perf)
        sq, pb = summarize(run_shared_queue(wl, cluster)), summarize(run_bound(wl, cluster))
        below = []
        for name in policy_names():
            s = summarize(run_policy(name, wl, cluster))
            if s["ttft_mean"] < sq["ttft_mean"] or s["ttft_p50"] < sq["ttft_p50"]:
                below.append(f"{name} {s['ttft_mean']:.3f} / {s['ttft_p50']:.3f}")
        print(
            f"| `{spec}` | {engines} | {sq['ttft_mean']:.3f} / {sq['ttft_p50']:.3f} | "
            f"{pb['ttft_mean']:.3f} / {pb['ttft_p50']:.3f} | {'; '.join(below) or 'none'} |"
        )
    return 0
