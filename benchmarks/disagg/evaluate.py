"""Disaggregated-serving evaluation tables for docs/evaluation.md (and the worked example of
docs/disaggregation.md).

    python -m benchmarks.disagg.evaluate pd            # goodput per workload, both presets, and
                                                   # the smallest pool reaching round robin's
    python -m benchmarks.disagg.evaluate calibration   # cost model priced with the wrong GPU
    python -m benchmarks.disagg.evaluate why --presets mistral-7b-a6000 --workload mooncake
                                                   # where prefill work went, why requests missed
    python -m benchmarks.disagg.evaluate example       # the P/D rule's worked example

Workloads: ``gen:chat`` and ``gen:agent`` (production-shaped sessions), the Azure 2023
conversation trace (30 % synthetic sharing), the Mooncake synthetic trace and a bursty
tool-use generator; two SLO classes (30 % interactive 1 s / 50 ms, 70 % standard 5 s /
100 ms). Arrivals are scaled so that the offered prompt tokens are ``--load`` (0.6) of what
the 8 engines can prefill at full batches. Each policy runs on the prefill/decode split of the 8
engines that ``kvgate plan --pd``'s search finds for it (the planner's hill climb over the
number of prefill engines, to the best attainment). The default policy is the code's
(``gateway.config.PolicyConfig``), run in pair mode with the P/D rule. Each command prints
Markdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common import benchmark_parser, data_dir, run_table
from gateway.config import PolicyConfig
from gateway.perfmodel.model import PerfModel
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.sim.loop import ClusterSpec, SimRun
from gateway.sim.metrics import summarize
from gateway.sim.planner import Planner, PlanOptions, PlanRow, Probe
from gateway.sim.runner import run_policy
from gateway.sim.workloads import Workload, WorkloadOptions, load_workload

PRESETS = (DEFAULT_PRESET, "qwen2.5-7b-h100")
PD_MIX = "slo_mix=interactive:0.3,standard:0.7"
PAIR_BASELINES = ("round_robin", "least_loaded")
BASELINES = (*PAIR_BASELINES, "length_heuristic")
ENGINES = 8


_DEFAULT: list[str] = []


def default_policy() -> str:
    """The policy ``kvgate serve`` runs without ``--policy`` (``--default`` overrides it)."""
    return _DEFAULT[0] if _DEFAULT else PolicyConfig().name


def policies() -> list[str]:
    names = [*BASELINES, default_policy(), "cost_model"]
    return list(dict.fromkeys(names))


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prefill_capacity(perf: PerfModel) -> float:
    """Prompt tokens per second one engine prefills at full batches."""
    budget = perf.max_num_batched_tokens
    return budget / perf.step_time([(budget, 0)], 0, 0)


def at_load(wl: Workload, perf: PerfModel, load: float, engines: int = ENGINES) -> Workload:
    """``wl`` with arrivals scaled so its prompt tokens are ``load`` of the pool's prefill."""
    offered = sum(r.prompt_tokens for r in wl.requests) / wl.span
    return wl.scaled(load * engines * prefill_capacity(perf) / offered)


def workloads(perf: PerfModel, load: float, n: int) -> list[tuple[str, Workload]]:
    data = data_dir()
    specs = [
        ("chat", f"gen:chat?n={n}&{PD_MIX}", WorkloadOptions()),
        ("agent", f"gen:agent?n={n}&{PD_MIX}", WorkloadOptions()),
        (
            "azure-conv (30 % shared)",
            f"azure:{data / 'azure_llm_2023_conv.csv'}?share=0.3&{PD_MIX}",
            WorkloadOptions(limit=n),
        ),
        (
            "mooncake",
            f"mooncake:{data / 'mooncake_synthetic_trace.jsonl'}?{PD_MIX}",
            WorkloadOptions(limit=n),
        ),
        (
            "tool-use (gamma cv 3)",
            f"gen:tool_use?n={n}&rate=28&arrival=gamma&cv=3&tools=150&{PD_MIX}",
            WorkloadOptions(),
        ),
    ]
    return [(label, at_load(load_workload(spec, o), perf, load)) for label, spec, o in specs]


class Evaluation:
    """Simulations of one (preset, workload), memoised by (policy, engines, prefill)."""

    def __init__(self, wl: Workload, perf: PerfModel) -> None:
        self.wl = wl
        self.perf = perf
        self.planner = Planner(wl, PlanOptions(policies=[], perf=perf, target=1.01), say, None)
        self.rows: dict[str, PlanRow] = {}
        self.runs: dict[tuple[str, int, int], tuple[dict[str, Any], Counter[str]]] = {}

    def split(self, policy: str, n: int = ENGINES) -> Probe:
        """The planner's best prefill count for ``policy`` on ``n`` engines (kvgate plan --pd)."""
        row = self.rows.setdefault(policy, PlanRow(f"{policy}/pd", policy, True))
        return self.planner.best_split(row, n)

    def run(self, policy: str, n: int, k: int) -> tuple[dict[str, Any], Counter[str]]:
        key = (policy, n, k)
        if key not in self.runs:
            sim: SimRun = run_policy(
                policy, self.wl, ClusterSpec(n, self.perf, prefill_instances=k)
            )
            self.runs[key] = (summarize(sim), Counter(r.pd_reason for r in sim.records))
        return self.runs[key]

    def smallest_pool(self, policy: str, target: float, start: int = ENGINES) -> Probe | None:
        """The smallest pool (best split each) whose goodput reaches ``target``, counting
        down from ``start`` while it does."""
        best = None
        for n in range(start, 1, -1):
            probe = self.split(policy, n)
            if probe.attainment < target:
                break
            best = probe
        return best


def fmt(v: Any) -> str:
    return "–" if v is None else f"{v:.2f}"


def cmd_pd(args: argparse.Namespace) -> None:
    names = policies()
    default = default_policy()
    source = "given by --default" if _DEFAULT else "the code's: gateway.config"
    print(
        f"\nDefault policy: `{default}` ({source}), in pair mode with the P/D "
        f"rule; pair-mode baselines {', '.join(PAIR_BASELINES)}; P/D-native length_heuristic "
        f"and cost_model. {args.requests} requests per workload at load {args.load:g}; each "
        "policy on its own best prefill/decode split of the 8 engines (kvgate plan --pd's "
        "search).\n"
    )
    overall: dict[str, list[float]] = {p: [] for p in names}
    pools: list[str] = []
    for preset in args.presets:
        perf = load_preset(preset)
        means: dict[str, list[float]] = {p: [] for p in names}
        print(f"\n### {ENGINES} × {preset}: goodput (P+D split, p99 TTFT s)\n")
        print("| workload (req/s) | " + " | ".join(names) + " | default − best pair |")
        print("|---|" + "---:|" * (len(names) + 1))
        for label, wl in workloads(perf, args.load, args.requests):
            ev = Evaluation(wl, perf)
            cells = []
            for name in names:
                probe = ev.split(name)
                means[name].append(probe.attainment)
                k = probe.prefill
                p99 = fmt(probe.summary["ttft_p99"])
                cells.append(f"{probe.attainment:.1%} ({k}+{ENGINES - k}, {p99})")
            margin = means[default][-1] - max(means[p][-1] for p in PAIR_BASELINES)
            print(f"| {label} ({wl.rate:.1f}) | " + " | ".join(cells) + f" | {margin:+.1%} |")
            sys.stdout.flush()
            _, mix = ev.run(default, ENGINES, ev.split(default).prefill)
            say(f"[pd] {preset} {label}: {default} decisions {dict(mix)}")
            rr = ev.split("round_robin")
            found = ev.smallest_pool(default, rr.attainment)
            where = (
                f"{found.instances} ({found.prefill}+{found.instances - found.prefill}), "
                f"{found.attainment:.1%}"
                if found
                else "none up to 8"
            )
            pools.append(f"| {preset} | {label} | {rr.attainment:.1%} | {where} |")
        row = [f"**{statistics.mean(means[p]):.1%}**" for p in names]
        gap = statistics.mean(means[default]) - max(
            statistics.mean(means[p]) for p in PAIR_BASELINES
        )
        print(f"| mean | {' | '.join(row)} | **{gap:+.1%}** |")
        for p in names:
            overall[p] += means[p]
    pair = max(statistics.mean(overall[p]) for p in PAIR_BASELINES)
    best = max(statistics.mean(overall[p]) for p in BASELINES)
    mine = statistics.mean(overall[default])
    print(
        f"\nMean over every preset and workload: {default} {mine:.1%}; best pair-mode baseline "
        f"{pair:.1%} ({mine - pair:+.1%}); best baseline {best:.1%} ({mine - best:+.1%}); "
        f"cost_model {statistics.mean(overall['cost_model']):.1%}."
    )
    print(
        f"\n### Smallest pool reaching round robin's goodput on {ENGINES} engines ({default}, "
        "same offered load, best split at each size)\n"
    )
    print("| preset | workload | round_robin on 8 | smallest pool (P+D), goodput |")
    print("|---|---|---:|---:|")
    print("\n".join(pools))


def cmd_calibration(args: argparse.Namespace) -> None:
    """The cost model pricing with another GPU's constants (engines follow the cluster's)."""
    from gateway.policies.base import PolicyContext
    from gateway.policies.registry import create_policy
    from gateway.sim.loop import Simulation

    perf, wrong = load_preset(DEFAULT_PRESET), load_preset("llama3-8b-h100")
    print(
        f"\n### Calibrated vs uncalibrated cost model ({ENGINES} × {DEFAULT_PRESET}; the "
        "uncalibrated router prices with llama3-8b-h100's constants)\n"
    )
    print("| workload | split | calibrated | uncalibrated |")
    print("|---|---|---:|---:|")
    for label, wl in workloads(perf, args.load, args.requests):
        ev = Evaluation(wl, perf)
        k = ev.split(default_policy()).prefill
        cluster = ClusterSpec(ENGINES, perf, prefill_instances=k)
        good = ev.run("cost_model", ENGINES, k)[0]["goodput"]
        ctx = PolicyContext(block_size=wl.block_size, perf=wrong, pd=cluster.pd)
        bad = summarize(Simulation(cluster, create_policy("cost_model", ctx), wl).run())
        print(f"| {label} | {k}+{ENGINES - k} | {good:.1%} | {bad['goodput']:.1%} |")
        sys.stdout.flush()


def cmd_why(args: argparse.Namespace) -> None:
    """Where the prefill work went and why requests missed, on one workload and split."""
    perf = load_preset(args.presets[0])
    names = [*PAIR_BASELINES, default_policy(), "cost_model"]
    for label, wl in workloads(perf, args.load, args.requests):
        if not label.startswith(args.workload):
            continue
        print(f"\n### {label} on {args.split}+{ENGINES - args.split} × {perf.name}\n")
        print(
            "| policy | goodput | TTFT missed | TPOT missed (TTFT met) | remote prefill tokens "
            "per prefill engine, min–max | engine hit rate | decisions |"
        )
        print("|---|---:|---:|---:|---:|---:|---|")
        for name in dict.fromkeys(names):
            cluster = ClusterSpec(ENGINES, perf, prefill_instances=args.split)
            sim = run_policy(name, wl, cluster)
            tokens: Counter[str] = Counter()
            outcome: Counter[str] = Counter()
            for r in sim.records:
                if r.prefill_engine:
                    tokens[r.prefill_engine] += r.source.prompt_tokens
                slo = r.info.slo
                if r.ttft is None or r.ttft > slo.ttft_s:
                    outcome["ttft"] += 1
                elif r.tpot is not None and r.tpot > slo.tpot_s:
                    outcome["tpot"] += 1
            prompt = sum(r.source.prompt_tokens for r in sim.records)
            hit = sum(r.cached_tokens for r in sim.records) / prompt
            spread = sorted(tokens.values()) or [0]
            mix = ", ".join(
                f"{k} {v}" for k, v in Counter(r.pd_reason for r in sim.records).items()
            )
            print(
                f"| {name} | {summarize(sim)['goodput']:.1%} | {outcome['ttft']} | "
                f"{outcome['tpot']} | {spread[0] / 1e6:.2f}–{spread[-1] / 1e6:.2f} M | "
                f"{hit:.1%} | {mix} |"
            )
            sys.stdout.flush()


def cmd_example(args: argparse.Namespace) -> None:
    from benchmarks.disagg.example import print_example

    print_example(load_preset(args.presets[0]))


def main(argv: Sequence[str] | None = None) -> int:
    ap = benchmark_parser(__doc__, "benchmarks.disagg.evaluate")
    ap.add_argument("table", choices=["pd", "calibration", "why", "example"])
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets")
    ap.add_argument("--load", type=float, default=0.6, help="offered prompt tokens / capacity")
    ap.add_argument("--requests", type=int, default=1000, help="requests per workload")
    ap.add_argument("--default", help="evaluate this policy as the default (a candidate)")
    ap.add_argument("--workload", default="mooncake", help="why: the workload (label prefix)")
    ap.add_argument("--split", type=int, default=4, help="why: prefill engines of the 8")
    args = ap.parse_args(argv)
    if args.default:
        _DEFAULT[:] = [args.default]
    args.presets = [p for p in args.presets.split(",") if p]
    commands: dict[str, Callable[[argparse.Namespace], None]] = {
        "pd": cmd_pd,
        "calibration": cmd_calibration,
        "why": cmd_why,
        "example": cmd_example,
    }
    return run_table("benchmarks.disagg.evaluate", commands, args)


if __name__ == "__main__":
    sys.exit(main())
