"""Why predicted_ttft prefills a cached prompt again: the decisions that send a request away
from the engine holding most of its prompt (the chosen engine's hit below half the best hit,
the best hit over half the prompt), each counted by what left the holder out: the aging bound,
the TTFT or TPOT target (the filter), the TTFT margin, a cost tie, or a higher cost; for the
last, the mean difference of each cost term (chosen minus holder).

    python -m benchmarks.quality.reprefill WORKLOAD RATE [--requests 2000] [--preset P]
        [--options key=v;key=v]

WORKLOAD is any simulator spec, scaled to RATE req/s on average. docs/evaluation.md (why the
misses, measured) quotes this command.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import cast

from benchmarks.common import benchmark_parser
from benchmarks.quality.diagnose import parse_policy
from benchmarks.quality.steering import SteeringLog
from gateway.core.types import ClusterView, Decision, RequestInfo
from gateway.perfmodel.presets import load_preset
from gateway.policies.base import Policy, PolicyContext, build_config
from gateway.policies.predicted_ttft import PredictedTtftConfig, PredictedTtftPolicy, Prediction
from gateway.sim.loop import ClusterSpec, Simulation
from gateway.sim.metrics import slo_attainment, summarize
from gateway.sim.workloads import WorkloadOptions, load_workload


class ReprefillLog(SteeringLog):
    """predicted_ttft that records why a request left the engine holding its prompt."""

    def __init__(self, ctx: PolicyContext, config: PredictedTtftConfig | None = None) -> None:
        super().__init__(ctx, config)
        self.moved = 0
        self.why: Counter[str] = Counter()
        self.diff: dict[str, float] = defaultdict(float)

    def _excluded_by(self, holder: Prediction, req: RequestInfo, rows: list[Prediction]) -> str:
        """Which of ``decide``'s sets left ``holder`` out ("" when it was a candidate)."""
        sets = self.candidates(req, rows)
        if holder not in sets.pool:
            return "aging bound"
        if sets.ok and holder not in sets.ok:
            return "TTFT filter" if holder.ttft_s > req.slo.ttft_s else "TPOT filter"
        if sets.safe and holder not in sets.safe:
            return "TTFT margin"
        return ""

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        rows = self.predict(req, view, now)
        prices = self.prices(req, rows, self.predicted_output(req))
        decision = PredictedTtftPolicy.decide(self, req, view, now)
        self.decisions += 1
        best = max(p.hit_tokens for p in rows)
        chosen = next(p for p in rows if p.engine.id == decision.engine)
        if best > req.prompt_tokens // 2 and chosen.hit_tokens < best // 2:
            self.moved += 1
            holder = min((p for p in rows if p.hit_tokens == best), key=lambda p: p.cost)
            why = self._excluded_by(holder, req, rows)
            if not why:
                why = "tie" if holder.cost <= chosen.cost + self.config.tie_s else "cost"
            self.why[why] += 1
            if why == "cost":
                a = self.cost_terms(chosen, req, prices)
                b = self.cost_terms(holder, req, prices)
                for k in a:
                    self.diff[k] += a[k] - b[k]
        return decision


def main() -> None:
    ap = benchmark_parser(__doc__, "benchmarks.quality.reprefill")
    ap.add_argument("workload")
    ap.add_argument("rate", type=float, help="mean arrival rate, req/s")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--preset", default="mistral-7b-a6000")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--options", default="", help="predicted_ttft knobs, key=v;key=v")
    args = ap.parse_args()
    wl = load_workload(args.workload, WorkloadOptions(limit=args.requests))
    wl = wl.head(args.requests)
    wl = wl.scaled(args.rate / wl.rate)
    cluster = ClusterSpec(args.instances, load_preset(args.preset))
    _, opts = parse_policy("x:" + args.options) if args.options else ("", None)
    config = build_config(PredictedTtftConfig, opts, "predicted_ttft")
    ctx = PolicyContext(seed=0, block_size=wl.block_size, perf=cluster.perf)
    policy = ReprefillLog(ctx, config)
    run = Simulation(cluster, cast(Policy, policy), wl).run()
    s = summarize(run)
    print(
        f"{args.workload} at {args.rate:g} req/s ({len(wl.requests)} requests, {args.preset}, "
        f"{args.options or 'defaults'}): attainment {slo_attainment(run):.3f}, "
        f"hit {s['cache_hit_rate']:.3f}"
    )
    print(
        f"{policy.moved} of {policy.decisions} requests left the engine holding their prompt; "
        "what left the holder out: "
        + (", ".join(f"{k} {v}" for k, v in policy.why.most_common()) or "-")
    )
    if policy.why["cost"]:
        print("mean difference of each cost term where the holder cost more (chosen - holder, s):")
        for k, v in policy.diff.items():
            print(f"  {k:22s} {v / policy.why['cost']:+8.2f}")


if __name__ == "__main__":
    main()
