"""Policy evaluation tables for docs/evaluation.md: one command per table.

    python -m benchmarks.quality.evaluate TABLE [options]

    sweep             5 policies x workloads x 4/8 engines x load
    ablation          Preble's mechanisms added one at a time
    capacity          effective request capacity per policy and workload
    mooncake          the Mooncake synthetic trace (needs ../shared/data)
    dualmap           TTFT-SLO capacity and latency, 6 policies
    dualmap-ablation  DualMap's mechanisms one at a time
    scaling           8 -> 9 engines mid-run under dualmap
    suite             issue 13's suite: every policy x workload x preset against both bounds
                      (benchmarks/quality/suite.py)
    workload-stats [SPEC ...]       gen:chat / gen:agent statistics
    bound-check [SPEC:ENGINES ...]  policies below the bounds

Each prints Markdown tables. Loads are set per engine so that 1.0x sits near round robin's
saturation point on the default preset (mistral-7b-a6000); the sweep goes past it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from benchmarks.common import benchmark_parser, mooncake_trace, run_table
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.sim.loop import ClusterSpec
from gateway.sim.metrics import cache_hit_upper_bound, summarize
from gateway.sim.runner import capacity_search, run_policy
from gateway.sim.workloads import Workload, WorkloadOptions, load_workload

POLICIES = ["round_robin", "least_loaded", "cache_aware", "weighted_scorer", "preble"]
ALL_POLICIES = [*POLICIES, "dualmap"]


@dataclass(frozen=True)
class Bench:
    """A Preble-like workload and its per-engine request rate at 1.0x load."""

    name: str
    spec: str  # without rate and n
    per_engine_rps: float
    n: int = 2400


BENCHES = [
    Bench("tool_use", "gen:tool_use?tools=150", 7.0),
    Bench("long_doc_qa", "gen:long_doc_qa?docs=100", 1.0),
    Bench("multi_turn", "gen:multi_turn", 2.4),
    Bench("zipf_hotspot", "gen:zipf_hotspot", 3.0),
    Bench("no_sharing", "gen:no_sharing", 2.6),
]


def workload(bench: Bench, instances: int, scale: float, seed: int = 0) -> Workload:
    rate = bench.per_engine_rps * instances * scale
    sep = "&" if "?" in bench.spec else "?"
    spec = f"{bench.spec}{sep}n={bench.n}&rate={rate:g}"
    return load_workload(spec, WorkloadOptions(seed=seed))


def fmt(v: Any, kind: str = "s") -> str:
    if v is None:
        return "–"
    if kind == "pct":
        return f"{v:.0%}"
    if kind == "x":
        return f"{v:.2f}"
    return f"{v:.2f}"


ROW = "| {policy} | {hit} | {ttft_mean} | {ttft_p99} | {e2e_mean} | {e2e_p99} | {goodput} | {cv} |"
HEAD = (
    "| policy | hit rate (bound {bound}) | TTFT mean | TTFT p99 | E2E mean | E2E p99 | "
    "goodput | load CV |\n|---|---:|---:|---:|---:|---:|---:|---:|"
)


def table(results: Mapping[str, Mapping[str, Any]], bound: float) -> str:
    lines = [HEAD.format(bound=fmt(bound, "pct"))]
    for name, s in results.items():
        lines.append(
            ROW.format(
                policy=name,
                hit=fmt(s["cache_hit_rate"], "pct"),
                ttft_mean=fmt(s["ttft_mean"]),
                ttft_p99=fmt(s["ttft_p99"]),
                e2e_mean=fmt(s["e2e_mean"]),
                e2e_p99=fmt(s["e2e_p99"]),
                goodput=fmt(s["goodput"], "pct"),
                cv=fmt(s["load_cv_mean"], "x"),
            )
        )
    return "\n".join(lines)


def run_all(
    wl: Workload, cluster: ClusterSpec, policies: Iterable[tuple[str, str, dict[str, str]]]
) -> dict[str, dict[str, Any]]:
    out = {}
    for label, name, options in policies:
        out[label] = summarize(run_policy(name, wl, cluster, options=options or None))
    return out


def cmd_sweep(args: argparse.Namespace) -> None:
    perf = load_preset(args.preset)
    for bench in _benches(args):
        for instances in args.instances:
            for scale in args.scales:
                wl = workload(bench, instances, scale)
                cluster = ClusterSpec(instances, perf)
                res = run_all(wl, cluster, [(p, p, {}) for p in POLICIES])
                print(
                    f"\n### {bench.name}, {instances} engines, {scale:g}x load "
                    f"({wl.rate:.1f} req/s)\n"
                )
                print(table(res, cache_hit_upper_bound(wl)))
                sys.stdout.flush()


ABLATION = [
    ("E2 only", {"rebalance": "false", "replicate": "false", "pd_balance": "false"}, False),
    ("+ rebalancing", {"replicate": "false", "pd_balance": "false"}, False),
    ("+ replication", {"pd_balance": "false"}, False),
    ("+ P/D balancing", {}, False),
    ("+ local priority groups", {}, True),
]


def cmd_ablation(args: argparse.Namespace) -> None:
    perf = load_preset(args.preset)
    for bench in _benches(args):
        for scale in args.scales:
            wl = workload(bench, args.instances[-1], scale)
            res = {}
            for label, options, groups in ABLATION:
                cluster = ClusterSpec(args.instances[-1], perf, priority_groups=groups)
                res[label] = summarize(run_policy("preble", wl, cluster, options=options))
            print(
                f"\n### Preble ablation: {bench.name}, {args.instances[-1]} engines, "
                f"{scale:g}x load ({wl.rate:.1f} req/s)\n"
            )
            print(table(res, cache_hit_upper_bound(wl)))
            sys.stdout.flush()


def cmd_capacity(args: argparse.Namespace) -> None:
    perf = load_preset(args.preset)
    instances = args.instances[-1]
    print(
        f"\n### Effective request capacity (req/s with >= 90 % of requests meeting TTFT 5 s "
        f"and TPOT 100 ms), {instances} engines\n"
    )
    print("| workload | " + " | ".join(POLICIES) + " |")
    print("|---|" + "---:|" * len(POLICIES))
    for bench in _benches(args):
        wl = workload(bench, instances, 1.0)
        caps = []
        for name in POLICIES:
            cap, _ = capacity_search(name, wl, ClusterSpec(instances, perf), steps=4)
            caps.append(cap)
        base = caps[0] or 1.0
        cells = [f"{c:.1f} ({c / base:.2f}x)" for c in caps]
        print(f"| {bench.name} | " + " | ".join(cells) + " |")
        sys.stdout.flush()


def cmd_mooncake(args: argparse.Namespace) -> None:
    path = mooncake_trace()
    perf = load_preset(args.preset)
    wl = load_workload(f"mooncake:{path}", WorkloadOptions())
    for instances in args.instances:
        res = run_all(wl, ClusterSpec(instances, perf), [(p, p, {}) for p in POLICIES])
        print(f"\n### Mooncake synthetic trace, {instances} engines ({wl.rate:.1f} req/s)\n")
        print(table(res, cache_hit_upper_bound(wl)))
        sys.stdout.flush()


def mooncake_workload(limit: int | None = None, rate_scale: float = 1.0) -> Workload:
    path = mooncake_trace()
    return load_workload(f"mooncake:{path}", WorkloadOptions(limit=limit, rate_scale=rate_scale))


def dualmap_workloads(instances: int) -> list[tuple[str, Workload]]:
    """The Mooncake synthetic trace and the Zipf hot-spot generator."""
    zipf = Bench("zipf_hotspot", "gen:zipf_hotspot", 3.0)
    return [
        ("mooncake", mooncake_workload()),
        ("zipf_hotspot", workload(zipf, instances, 1.0)),
    ]


def cmd_dualmap(args: argparse.Namespace) -> None:
    perf = load_preset(args.preset)
    for instances in args.instances:
        for label, wl in dualmap_workloads(instances):
            cluster = ClusterSpec(instances, perf)
            rows = []
            for name in ALL_POLICIES:
                s = summarize(run_policy(name, wl, cluster))
                cap, _ = capacity_search(name, wl, cluster, steps=4, ttft_only=True)
                rows.append((name, s, cap))
            base = rows[0][2] or 1.0
            print(f"\n### {label}, {instances} engines ({wl.rate:.1f} req/s offered)\n")
            print(
                "| policy | capacity req/s (TTFT<=5 s for 90 %) | TTFT p50 | TTFT p90 | "
                "TTFT p99 | hit rate | load CV | held | migrated |"
            )
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            for name, s, cap in rows:
                print(
                    f"| {name} | {cap:.2f} ({cap / base:.2f}x) | {fmt(s['ttft_p50'])} | "
                    f"{fmt(s['ttft_p90'])} | {fmt(s['ttft_p99'])} | "
                    f"{fmt(s['cache_hit_rate'], 'pct')} | {fmt(s['load_cv_mean'], 'x')} | "
                    f"{s['held']} | {s['migrations']} |"
                )
            sys.stdout.flush()


DUALMAP_ABLATION = [
    ("dualmap (adaptive key, SLO-aware, queues, rebalancing)", {}),
    ("fixed key: first block", {"adaptive": "false", "fixed_depth": "1"}),
    ("fixed key: first 8 blocks", {"adaptive": "false", "fixed_depth": "8"}),
    ("no rebalancing", {"rebalance": "false"}),
    ("affinity only (no SLO-aware choice)", {"slo_aware": "false"}),
    ("no router queues", {"queueing": "false"}),
]


def cmd_dualmap_ablation(args: argparse.Namespace) -> None:
    perf = load_preset(args.preset)
    instances = args.instances[-1]
    for label, wl in dualmap_workloads(instances):
        cluster = ClusterSpec(instances, perf)
        print(f"\n### DualMap ablation: {label}, {instances} engines ({wl.rate:.1f} req/s)\n")
        print("| variant | capacity req/s (TTFT) | TTFT p50 | TTFT p99 | hit rate | load CV |")
        print("|---|---:|---:|---:|---:|---:|")
        for variant, options in DUALMAP_ABLATION:
            s = summarize(run_policy("dualmap", wl, cluster, options=options))
            cap, _ = capacity_search(
                "dualmap", wl, cluster, options=options, steps=4, ttft_only=True
            )
            print(
                f"| {variant} | {cap:.2f} | {fmt(s['ttft_p50'])} | {fmt(s['ttft_p99'])} | "
                f"{fmt(s['cache_hit_rate'], 'pct')} | {fmt(s['load_cv_mean'], 'x')} |"
            )
            sys.stdout.flush()


def cmd_scaling(args: argparse.Namespace) -> None:
    from gateway.policies.base import PolicyContext
    from gateway.policies.dualmap import DualMapPolicy
    from gateway.policies.hash_ring import HashRing
    from gateway.sim.metrics import percentile

    perf = load_preset(args.preset)
    wl = workload(Bench("zipf_hotspot", "gen:zipf_hotspot", 3.0), 8, 1.0)
    t0 = wl.requests[0].arrival
    at = t0 + wl.span / 2
    runs = {
        "8 engines throughout": ClusterSpec(8, perf),
        "8 -> 9 engines at mid-run": ClusterSpec(8, perf, scale_events=((at, 9),)),
    }
    policy = DualMapPolicy(PolicyContext(perf=perf))
    keys = [policy.key(r) for r in (_info(q) for q in wl.requests)]
    before = [policy.rings[i] for i in range(2)]
    for ring in before:
        ring.set_engines([f"sim-{i}" for i in range(8)])
    distinct = sorted({k for k, _ in keys})
    pairs_before = {k: (before[0].lookup(k), before[1].lookup(k)) for k in distinct}
    for ring in before:
        ring.add("sim-8")
    pairs_after = {k: (before[0].lookup(k), before[1].lookup(k)) for k in distinct}
    moved = [
        sum(1 for k in distinct if pairs_before[k][i] != pairs_after[k][i]) / len(distinct)
        for i in range(2)
    ]
    traffic = sum(1 for k, _ in keys if pairs_before[k] != pairs_after[k]) / len(keys)
    import random

    rng = random.Random(7)
    sample = [rng.getrandbits(64) for _ in range(20_000)]
    fresh = [HashRing(seed=r.seed, vnodes=r.vnodes) for r in before]
    for ring in fresh:
        ring.set_engines([f"sim-{i}" for i in range(8)])
    old_owner = [[ring.lookup(k) for k in sample] for ring in fresh]
    for ring in fresh:
        ring.add("sim-8")
    random_moved = [
        sum(1 for k, o in zip(sample, old_owner[i], strict=True) if fresh[i].lookup(k) != o)
        / len(sample)
        for i in range(2)
    ]
    print(f"\n### Scaling 8 -> 9 engines (zipf_hotspot, {wl.rate:.1f} req/s, dualmap)\n")
    print(
        f"Adding the 9th engine remaps {moved[0]:.1%} of the {len(distinct)} distinct keys on "
        f"ring 1 and {moved[1]:.1%} on ring 2 (ideal 1/9 = 11.1 %); {traffic:.1%} of requests "
        "had at least one candidate changed."
    )
    print(f"Over 20,000 random keys: ring 1 {random_moved[0]:.1%}, ring 2 {random_moved[1]:.1%}.\n")
    print("| run | TTFT p99 before | TTFT p99 after (30 s) | TTFT p99 after (rest) | hit rate |")
    print("|---|---:|---:|---:|---:|")
    for label, cluster in runs.items():
        run = run_policy("dualmap", wl, cluster)

        def p99(lo: float, hi: float, recs=run.records) -> float | None:
            return percentile(
                [r.ttft for r in recs if r.ttft is not None and lo <= r.source.arrival < hi], 99
            )

        s = summarize(run)
        print(
            f"| {label} | {fmt(p99(t0, at))} | {fmt(p99(at, at + 30))} | "
            f"{fmt(p99(at + 30, float('inf')))} | {fmt(s['cache_hit_rate'], 'pct')} |"
        )


def _info(q: Any) -> Any:
    from gateway.core.types import RequestInfo

    return RequestInfo(
        id=q.id, block_hashes=q.block_hashes, prompt_tokens=q.prompt_tokens, arrival=q.arrival
    )


def _benches(args: argparse.Namespace) -> list[Bench]:
    names = args.workloads.split(",") if args.workloads else [b.name for b in BENCHES]
    known = {b.name: b for b in BENCHES}
    return [known[n] for n in names]


def main() -> int:
    if sys.argv[1:2] == ["suite"]:
        from benchmarks.quality.suite import main as suite_main

        return suite_main(sys.argv[2:])
    if sys.argv[1:2] == ["workload-stats"]:
        from benchmarks.quality.suite_tools import workload_stats

        return workload_stats(sys.argv[2:])
    if sys.argv[1:2] == ["bound-check"]:
        from benchmarks.quality.suite_tools import bound_check

        return bound_check(sys.argv[2:])
    ap = benchmark_parser(__doc__, "benchmarks.quality.evaluate")
    ap.add_argument(
        "table",
        choices=[
            "sweep",
            "ablation",
            "capacity",
            "mooncake",
            "dualmap",
            "dualmap-ablation",
            "scaling",
            "suite",
            "workload-stats",
            "bound-check",
        ],
    )
    ap.add_argument("--workloads", default="", help="comma-separated subset of the workloads")
    ap.add_argument("--instances", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8])
    ap.add_argument(
        "--scales", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0, 1.5]
    )
    ap.add_argument("--preset", default=DEFAULT_PRESET)
    args = ap.parse_args()
    commands: dict[str, Callable[[argparse.Namespace], None]] = {
        "sweep": cmd_sweep,
        "ablation": cmd_ablation,
        "capacity": cmd_capacity,
        "mooncake": cmd_mooncake,
        "dualmap": cmd_dualmap,
        "dualmap-ablation": cmd_dualmap_ablation,
        "scaling": cmd_scaling,
    }
    return run_table("benchmarks.quality.evaluate", commands, args)


if __name__ == "__main__":
    sys.exit(main())
