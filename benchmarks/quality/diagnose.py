"""Why a policy misses its SLO at one rate: the share of requests that miss only TTFT, only
TPOT or both, hit rate, latency percentiles and per-engine shares, one line per policy.

    python -m benchmarks.quality.diagnose WORKLOAD RATE [--policies a,b:key=v;key=v] [--preset P]
        [--requests N] [--instances 8]

WORKLOAD is any simulator spec (``gen:agent?n=1500``, ``mooncake:PATH``...), scaled to RATE
req/s on average; ``policy:key=value;key=value`` sets options. The numbers docs/evaluation.md
quotes next to "Why, measured" come from this command. The name ``shared_queue`` runs the
shared-queue bound (``gateway/sim/shared_queue.py``) in a policy's place.
"""

from __future__ import annotations

from collections import Counter

from benchmarks.common import benchmark_parser
from gateway.perfmodel.presets import load_preset
from gateway.sim.loop import ClusterSpec
from gateway.sim.metrics import slo_attainment, summarize
from gateway.sim.runner import run_policy
from gateway.sim.shared_queue import run_shared_queue
from gateway.sim.workloads import WorkloadOptions, load_workload


def parse_policy(text: str) -> tuple[str, dict[str, str] | None]:
    name, _, opts = text.partition(":")
    options = dict(kv.split("=", 1) for kv in opts.split(";")) if opts else None
    return name, options


def main() -> None:
    ap = benchmark_parser(__doc__, "benchmarks.quality.diagnose")
    ap.add_argument("workload")
    ap.add_argument("rate", type=float)
    ap.add_argument("--policies", default="least_loaded,predicted_ttft")
    ap.add_argument("--preset", default="mistral-7b-a6000")
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--instances", type=int, default=8)
    args = ap.parse_args()
    wl = load_workload(args.workload, WorkloadOptions(limit=args.requests))
    if len(wl.requests) > args.requests:
        wl = wl.head(args.requests)
    wl = wl.scaled(args.rate / wl.rate)
    cluster = ClusterSpec(args.instances, load_preset(args.preset))
    print(f"{args.workload}: {len(wl.requests)} requests at {args.rate:g} req/s, {args.preset}")
    for text in args.policies.split(","):
        name, options = parse_policy(text)
        if name == "shared_queue":
            run = run_shared_queue(wl, cluster)
        else:
            run = run_policy(name, wl, cluster, options=options)
        s = summarize(run)
        ttft_only = tpot_only = both = 0
        per: Counter[str] = Counter()
        for r in run.records:
            per[str(r.engine)] += 1
            slow_first = r.ttft is None or r.ttft > r.source.slo.ttft_s
            slow_decode = r.tpot is not None and r.tpot > r.source.slo.tpot_s
            ttft_only += slow_first and not slow_decode
            tpot_only += slow_decode and not slow_first
            both += slow_first and slow_decode
        n = len(run.records)
        shares = " ".join(f"{v / n:.2f}" for v in sorted(per.values(), reverse=True))
        print(
            f"{text:40s} attainment {slo_attainment(run):.3f}  missed TTFT only "
            f"{ttft_only / n:.3f}, TPOT only {tpot_only / n:.3f}, both {both / n:.3f}  hit "
            f"{s['cache_hit_rate']:.3f}  TTFT p50/p90 {s['ttft_p50']:.2f}/{s['ttft_p90']:.2f} s"
            f"  TPOT p50/p99 {s['tpot_p50']:.3f}/{s['tpot_p99']:.3f} s  shares {shares}"
        )


if __name__ == "__main__":
    main()
