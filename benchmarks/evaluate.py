"""Policy evaluation tables for docs/evaluation.md: one command per table.

    python benchmarks/evaluate.py sweep      # 5 policies x workloads x 4/8 engines x load
    python benchmarks/evaluate.py ablation   # Preble's mechanisms added one at a time
    python benchmarks/evaluate.py capacity   # effective request capacity per policy and workload
    python benchmarks/evaluate.py mooncake   # the Mooncake synthetic trace (needs ../shared/data)

Each prints Markdown tables. Loads are set per engine so that 1.0x sits near round robin's
saturation point on the default preset (mistral-7b-a6000); the sweep goes past it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.sim.loop import ClusterSpec
from gateway.sim.metrics import cache_hit_upper_bound, summarize
from gateway.sim.runner import capacity_search, run_policy
from gateway.sim.workloads import Workload, WorkloadOptions, load_workload

POLICIES = ["round_robin", "least_loaded", "cache_aware", "weighted_scorer", "preble"]
ROOT = Path(__file__).resolve().parents[1]


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
    data = os.environ.get("KVGATE_DATA", str(ROOT.parent / "shared" / "data"))
    path = Path(data) / "mooncake_synthetic_trace.jsonl"
    perf = load_preset(args.preset)
    wl = load_workload(f"mooncake:{path}", WorkloadOptions())
    for instances in args.instances:
        res = run_all(wl, ClusterSpec(instances, perf), [(p, p, {}) for p in POLICIES])
        print(f"\n### Mooncake synthetic trace, {instances} engines ({wl.rate:.1f} req/s)\n")
        print(table(res, cache_hit_upper_bound(wl)))
        sys.stdout.flush()


def _benches(args: argparse.Namespace) -> list[Bench]:
    names = args.workloads.split(",") if args.workloads else [b.name for b in BENCHES]
    known = {b.name: b for b in BENCHES}
    return [known[n] for n in names]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", choices=["sweep", "ablation", "capacity", "mooncake"])
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
    }
    t0 = time.perf_counter()
    commands[args.table](args)
    print(
        f"\n_(generated by `python benchmarks/evaluate.py {' '.join(sys.argv[1:])}` in "
        f"{time.perf_counter() - t0:.0f} s)_"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
