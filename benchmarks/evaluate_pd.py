"""Disaggregated-serving evaluation tables for docs/evaluation.md.

    python benchmarks/evaluate_pd.py pd         # goodput on 3 bursty traces, 3P+5D, calibration
    python benchmarks/evaluate_pd.py pd-sweep   # pool size 3..16, smallest pool

Each prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.sim.loop import ClusterSpec
from gateway.sim.metrics import summarize
from gateway.sim.runner import run_policy
from gateway.sim.workloads import Workload, WorkloadOptions, load_workload

ROOT = Path(__file__).resolve().parents[1]


def fmt(v: Any) -> str:
    return "–" if v is None else f"{v:.2f}"


PD_POLICIES = ["round_robin", "least_loaded", "length_heuristic", "cost_model"]
PD_MIX = "slo_mix=interactive:0.3,standard:0.7"


def pd_traces(instances: int = 8, load: float = 1.0) -> list[tuple[str, Workload]]:
    """Three bursty mixed traces for disaggregated serving, scaled with the pool size."""
    data = os.environ.get("KVGATE_DATA", str(ROOT.parent / "shared" / "data"))
    k = instances / 8 * load
    azure = Path(data) / "azure_llm_2023_conv.csv"
    mooncake = Path(data) / "mooncake_synthetic_trace.jsonl"
    opts = WorkloadOptions(limit=3000, rate_scale=6.5 * k)
    return [
        (
            "azure-conv (6.5x, 30 % shared)",
            load_workload(f"azure:{azure}?share=0.3&{PD_MIX}", opts),
        ),
        (
            "mooncake (1x)",
            load_workload(
                f"mooncake:{mooncake}?{PD_MIX}", WorkloadOptions(limit=2000, rate_scale=k)
            ),
        ),
        (
            "bursty tool-use (gamma cv 3)",
            load_workload(
                f"gen:tool_use?n=3000&rate={28 * k:g}&arrival=gamma&cv=3&tools=150&{PD_MIX}",
                WorkloadOptions(),
            ),
        ),
    ]


def _pd_goodput(
    name: str, wl: Workload, cluster: ClusterSpec, options: dict[str, str] | None = None
) -> dict[str, Any]:
    return summarize(run_policy(name, wl, cluster, options=options))


def cmd_pd(args: argparse.Namespace) -> None:
    import statistics

    perf = load_preset(args.preset)
    cluster = ClusterSpec(8, perf, prefill_instances=3)
    table: dict[str, list[float]] = {p: [] for p in PD_POLICIES}
    print(
        "\n### Disaggregated serving: 3 prefill + 5 decode engines, goodput (TTFT and TPOT "
        "of each request's class: interactive 1 s / 50 ms, standard 5 s / 100 ms)\n"
    )
    print("| trace | " + " | ".join(PD_POLICIES) + " |")
    print("|---|" + "---:|" * len(PD_POLICIES))
    for label, wl in pd_traces():
        cells = []
        for name in PD_POLICIES:
            s = _pd_goodput(name, wl, cluster)
            table[name].append(s["goodput"])
            cells.append(f"{s['goodput']:.1%} (p99 TTFT {fmt(s['ttft_p99'])})")
        print(f"| {label} ({wl.rate:.1f} req/s) | " + " | ".join(cells) + " |")
        sys.stdout.flush()
    means = [
        f"**{statistics.mean(table[p]):.1%}** ± {statistics.pstdev(table[p]):.1%}"
        for p in PD_POLICIES
    ]
    print("| mean ± std over traces | " + " | ".join(means) + " |")
    # calibrated vs uncalibrated: the router prices with another hardware's constants
    wrong = load_preset("llama3-8b-h100")
    print(
        "\n### Calibrated vs uncalibrated cost model (cluster: mistral-7b-a6000; "
        "uncalibrated router uses the llama3-8b-h100 constants)\n"
    )
    print("| trace | cost_model, calibrated | cost_model, uncalibrated |")
    print("|---|---:|---:|")
    for label, wl in pd_traces():
        good = _pd_goodput("cost_model", wl, cluster)["goodput"]
        ctx_wrong = _run_with_perf("cost_model", wl, cluster, wrong)["goodput"]
        print(f"| {label} | {good:.1%} | {ctx_wrong:.1%} |")
        sys.stdout.flush()


def _run_with_perf(
    name: str, wl: Workload, cluster: ClusterSpec, router_perf: Any
) -> dict[str, Any]:
    """A run whose policy prices with ``router_perf`` while engines follow the cluster's."""
    from gateway.policies.base import PolicyContext
    from gateway.policies.registry import create_policy
    from gateway.sim.loop import Simulation

    ctx = PolicyContext(block_size=wl.block_size, perf=router_perf, pd=cluster.pd)
    policy = create_policy(name, ctx)
    return summarize(Simulation(cluster, policy, wl).run())


def cmd_pd_sweep(args: argparse.Namespace) -> None:
    perf = load_preset(args.preset)
    label, _ = pd_traces()[0]
    print(f"\n### Pool size sweep ({label}, load proportional to the pool, 3/8 prefill)\n")
    print("| engines (P+D) | " + " | ".join(PD_POLICIES) + " | cost_model vs round_robin |")
    print("|---|" + "---:|" * (len(PD_POLICIES) + 1))
    for n in (3, 4, 6, 8, 12, 16):
        k = max(1, round(n * 3 / 8))
        _, wl = pd_traces(n)[0]
        cluster = ClusterSpec(n, perf, prefill_instances=k)
        goods = [_pd_goodput(p, wl, cluster)["goodput"] for p in PD_POLICIES]
        cells = [f"{g:.1%}" for g in goods]
        print(f"| {n} ({k}+{n - k}) | " + " | ".join(cells) + f" | {goods[-1] - goods[0]:+.1%} |")
        sys.stdout.flush()
    _, wl = pd_traces(8)[0]
    target = _pd_goodput("round_robin", wl, ClusterSpec(8, perf, prefill_instances=3))["goodput"]
    print(
        f"\n### Smallest pool reaching round robin's goodput on 8 engines ({target:.1%}), "
        "same offered load\n"
    )
    print("| policy | smallest pool (P+D) | goodput there |")
    print("|---|---:|---:|")
    for name in PD_POLICIES:
        found = "> 12"
        for n in range(3, 13):
            k = max(1, round(n * 3 / 8))
            g = _pd_goodput(name, wl, ClusterSpec(n, perf, prefill_instances=k))["goodput"]
            if g >= target:
                found = f"{n} ({k}+{n - k}) | {g:.1%}"
                break
        print(f"| {name} | {found} |" if "|" in found else f"| {name} | {found} | – |")
        sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", choices=["pd", "pd-sweep"])
    ap.add_argument("--preset", default=DEFAULT_PRESET)
    args = ap.parse_args()
    commands: dict[str, Callable[[argparse.Namespace], None]] = {
        "pd": cmd_pd,
        "pd-sweep": cmd_pd_sweep,
    }
    t0 = time.perf_counter()
    commands[args.table](args)
    print(
        f"\n_(generated by `python benchmarks/evaluate_pd.py {' '.join(sys.argv[1:])}` in "
        f"{time.perf_counter() - t0:.0f} s)_"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
