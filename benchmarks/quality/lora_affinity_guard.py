"""LoRA affinity's load guard on simulated multi-adapter traffic (``gen:lora``).

Runs each policy with the adapter narrowing off, without a guard, and with each
``factor:margin`` guard, on 4 simulated engines with ``--max-loras`` slots, and
prints cache hit rate, TTFT and goodput (share of requests meeting the SLO) and
adapter loads from disk. docs/policies.md quotes its numbers.

    .venv/bin/python -m benchmarks.quality.lora_affinity_guard --rate-scale 0.5 --max-loras 1
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from benchmarks.common import benchmark_parser
from gateway.core.types import ClusterView, RequestInfo
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.policies import dispatcher
from gateway.policies.lora_affinity import LoraAffinityConfig, narrow_to_adapter
from gateway.sim.loop import ClusterSpec
from gateway.sim.metrics import summarize
from gateway.sim.runner import run_policy
from gateway.sim.workloads import WorkloadOptions, load_workload


def _narrowing(
    config: LoraAffinityConfig | None,
) -> Callable[[RequestInfo, ClusterView], ClusterView]:
    def narrow(req: RequestInfo, view: ClusterView) -> ClusterView:
        return view if config is None else narrow_to_adapter(req, view, config)

    return narrow


def main() -> None:
    ap = benchmark_parser(__doc__, "benchmarks.quality.lora_affinity_guard")
    ap.add_argument("--workload", default="gen:lora")
    ap.add_argument("--rate-scale", type=float, default=0.5)
    ap.add_argument("--limit", type=int, default=1500)
    ap.add_argument("--max-loras", type=int, default=1)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--policies", default="least_loaded,predicted_ttft")
    ap.add_argument("--guards", default="2:4,2:16", help="factor:margin,...")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    options = WorkloadOptions(limit=args.limit, rate_scale=args.rate_scale, seed=args.seed)
    workload = load_workload(args.workload, options)
    perf = replace(
        load_preset(DEFAULT_PRESET), max_loras=args.max_loras, max_cpu_loras=2 * args.max_loras
    )
    variants: dict[str, LoraAffinityConfig | None] = {
        "off": None,
        "no guard": LoraAffinityConfig(factor=math.inf, margin=0),
    }
    for item in args.guards.split(","):
        factor, margin = item.split(":")
        variants[f"{factor}x+{margin}"] = LoraAffinityConfig(float(factor), int(margin))
    print(
        f"{args.workload} x{args.rate_scale}, {args.limit} requests, {args.instances} engines, "
        f"--max-loras {args.max_loras}, seed {args.seed}"
    )
    print(
        f"{'policy':15} {'affinity':9} {'hit':>6} {'TTFT mean':>9} {'p50':>7} {'p99':>8} "
        f"{'goodput':>7} {'loads':>6}"
    )
    for policy in args.policies.split(","):
        for name, config in variants.items():
            dispatcher.narrow_to_adapter = _narrowing(config)  # type: ignore[attr-defined,assignment]
            s = summarize(run_policy(policy, workload, ClusterSpec(args.instances, perf)))
            print(
                f"{policy:15} {name:9} {s['cache_hit_rate']:6.3f} {s['ttft_mean']:9.3f} "
                f"{s['ttft_p50']:7.3f} {s['ttft_p99']:8.3f} {s['goodput']:7.3f} "
                f"{s.get('lora_loads', 0):6}",
                flush=True,
            )


if __name__ == "__main__":
    main()
