"""Which of predicted_ttft's prices send requests away from the engine that would start them
soonest: per decision, the chosen engine's predicted TTFT against the least-wait engine's, and,
for the decisions steered more than ``--margin`` seconds away, the mean difference of each
cost term (chosen minus least-wait; negative terms paid for the longer wait).

    python -m benchmarks.quality.steering WORKLOAD SCALE [--requests 800] [--preset P]
        [--options key=v;key=v] [--margin 2]

docs/evaluation.md (small, overloaded pools) quotes this command.
"""

from __future__ import annotations

from collections import defaultdict
from typing import cast

from benchmarks.common import benchmark_parser
from benchmarks.quality.diagnose import parse_policy
from gateway.core.types import ClusterView, Decision, RequestInfo
from gateway.perfmodel.presets import load_preset
from gateway.policies.base import Policy, PolicyContext, build_config
from gateway.policies.predicted_ttft import (
    PredictedTtftConfig,
    PredictedTtftPolicy,
)
from gateway.sim.loop import ClusterSpec, Simulation
from gateway.sim.metrics import summarize
from gateway.sim.workloads import WorkloadOptions, load_workload


class SteeringLog(PredictedTtftPolicy):
    """predicted_ttft that records, per decision, how far it steered from the least wait."""

    margin: float = 2.0

    def __init__(self, ctx: PolicyContext, config: PredictedTtftConfig | None = None) -> None:
        super().__init__(ctx, config)
        self.decisions = 0
        self.steered = 0
        self.terms: dict[str, float] = defaultdict(float)

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        rows = self.predict(req, view, now)
        prices = self.prices(req, rows, self.predicted_output(req))
        decision = super().decide(req, view, now)
        self.decisions += 1
        least = min(rows, key=lambda p: p.ttft_s)
        chosen = next(p for p in rows if p.engine.id == decision.engine)
        if chosen.ttft_s - least.ttft_s > self.margin:
            self.steered += 1
            a = self.cost_terms(chosen, req, prices)
            b = self.cost_terms(least, req, prices)
            for k in a:
                self.terms[k] += a[k] - b[k]
        return decision


def main() -> None:
    ap = benchmark_parser(__doc__, "benchmarks.quality.steering")
    ap.add_argument("workload")
    ap.add_argument("scale", type=float, help="arrival-rate factor")
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--preset", default="mistral-7b-a6000")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--options", default="", help="predicted_ttft knobs, key=v;key=v")
    ap.add_argument("--margin", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    wl = load_workload(args.workload, WorkloadOptions(limit=args.requests))
    wl = wl.head(args.requests).scaled(args.scale)
    cluster = ClusterSpec(args.instances, load_preset(args.preset))
    _, opts = parse_policy("x:" + args.options) if args.options else ("", None)
    config = build_config(PredictedTtftConfig, opts, "predicted_ttft")
    ctx = PolicyContext(seed=args.seed, block_size=wl.block_size, perf=cluster.perf)
    policy = SteeringLog(ctx, config)
    policy.margin = args.margin
    s = summarize(Simulation(cluster, cast(Policy, policy), wl).run())
    print(
        f"{args.workload} x{args.scale:g} ({wl.rate:.2f} req/s, {len(wl.requests)} requests, "
        f"{args.preset}): TTFT p50 {s['ttft_p50']:.1f} s, p99 {s['ttft_p99']:.1f} s"
    )
    n = max(1, policy.steered)
    print(
        f"{policy.steered} of {policy.decisions} decisions went to an engine predicted more "
        f"than {args.margin:g} s slower to start the request than the least-wait engine; "
        "mean difference of each term there (chosen - least-wait, s):"
    )
    for k, v in policy.terms.items():
        print(f"  {k:22s} {v / n:+8.2f}")


if __name__ == "__main__":
    main()
