"""Simulator speed: the whole Mooncake synthetic trace, 8 instances, 5 policies, one core.

Target (issue #2): all five policies in under 60 s on one core of the CI machine.

    python -m benchmarks.speed.simulator [--trace PATH] [--instances 8] [--policies ...]

The trace path defaults to $KVGATE_DATA/mooncake_synthetic_trace.jsonl, else
../shared/data/mooncake_synthetic_trace.jsonl (relative to the repository root).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

from benchmarks.common import benchmark_parser, mooncake_trace
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.sim.loop import ClusterSpec
from gateway.sim.metrics import summarize
from gateway.sim.runner import run_policy
from gateway.sim.workloads import WorkloadOptions, load_workload

TARGET_S = 60.0
POLICIES = "round_robin,least_loaded,power_of_two,cache_aware,weighted_scorer"


def main() -> int:
    ap = benchmark_parser(__doc__, "benchmarks.speed.simulator")
    ap.add_argument("--trace", type=Path, default=mooncake_trace())
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--preset", default=DEFAULT_PRESET)
    args = ap.parse_args()
    if not args.trace.is_file():
        print(f"trace not found: {args.trace} (set KVGATE_DATA or --trace)", file=sys.stderr)
        return 2
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as the target says
    t0 = time.perf_counter()
    workload = load_workload(f"mooncake:{args.trace}", WorkloadOptions())
    load_s = time.perf_counter() - t0
    cluster = ClusterSpec(args.instances, load_preset(args.preset))
    print(f"trace: {len(workload)} requests, loaded and hashed in {load_s:.2f} s")
    print(f"{'policy':<16} {'wall s':>7} {'events':>8} {'steps':>8} {'ev/s':>9} {'hit':>6}")
    total = load_s
    for name in args.policies.split(","):
        t = time.perf_counter()
        run = run_policy(name, workload, cluster, timer=time.perf_counter)
        dt = time.perf_counter() - t
        total += dt
        hit = summarize(run)["cache_hit_rate"]
        print(
            f"{name:<16} {dt:7.2f} {run.events:8d} {run.engine_steps:8d} "
            f"{run.events / dt:9.0f} {hit:6.1%}"
        )
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"total {total:.1f} s for {len(args.policies.split(','))} policies "
        f"(target < {TARGET_S:.0f} s: ratio {total / TARGET_S:.2f}); peak RSS {rss_mb:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
