"""The routing suite (issue 13): every policy's capacity on every workload, against both bounds.

    python -m benchmarks.quality.evaluate suite [--jobs 2] [--presets a,b] [--workloads chat,agent]
        [--policies x,y] [--requests 1500] [--instances 8] [--json out.json]

Per preset and workload: the capacity (highest rate at which >= 90 % of requests meet
TTFT 5 s and TPOT 100 ms; search to ±2 %) of every policy of the registry and of the
shared-queue and pooled bounds; each policy's ratio to least_loaded, to the best
baseline, to the shared-queue bound and to the pooled bound; the workload's reusable
share of prompt tokens (the infinite-cache bound); the hit rate at the reference load
(half the shared-queue bound's capacity) against the pooled bound's at the same rate;
and the attainment curve at 25/50/75/100 % of the shared-queue capacity. The
Preble-style generators run 4x ``--requests`` (cheap prompts; a 1,500-request run
on eight 80 GB engines is over before any queue builds). Tasks run in
``--jobs`` processes; progress goes to stderr, Markdown to stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.common import benchmark_parser, data_dir
from gateway.perfmodel.engine import EngineCore
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.policies.registry import policy_names
from gateway.sim.bound import bound_capacity, run_bound
from gateway.sim.early_stop import MissBudget, ProbeFailed
from gateway.sim.loop import ClusterSpec, SimRun
from gateway.sim.metrics import cache_hit_upper_bound, slo_attainment, summarize
from gateway.sim.runner import capacity_search, run_policy
from gateway.sim.shared_queue import run_shared_queue, shared_queue_capacity
from gateway.sim.workloads import Workload, WorkloadOptions, load_workload

T = TypeVar("T")
R = TypeVar("R")

PRESETS = [DEFAULT_PRESET, "qwen2.5-7b-h100"]
BASELINES = ["round_robin", "least_loaded", "power_of_two", "cache_aware", "weighted_scorer"]
BASELINES += ["kv_cost"]  # Dynamo's router, once the registry has it
CURVE = (0.25, 0.5, 0.75, 1.0)
"""Attainment-curve rates, as fractions of the shared-queue bound's capacity."""
CURVE_FLOOR = 0.5
"""Curve runs stop once attainment is certainly below this (shown as "<50%")."""
REFERENCE = 0.5
"""The reference load (hit rates, latencies): this fraction of the shared-queue capacity."""
POLICY_BRACKET = 1.25
"""Policies' searches start at 0.7x the shared-queue capacity and bracket by this factor."""
CAP = 64.0
"""Every search (bounds and policies) stops at 64x the workload's own rate (reported "≥")."""


@dataclass(frozen=True)
class SuiteWorkload:
    name: str
    spec: str  # {n} = requests, {data} = the traces folder
    trace: str = ""  # file the spec needs under {data}
    paper: str = ""  # published gain over least-loaded, for comparison
    size: int = 1  # requests = size x --requests (cheap generators: long enough a span)


WORKLOADS = [
    SuiteWorkload("chat", "gen:chat?n={n}", paper="DualMap +40–80 % (conversation)"),
    SuiteWorkload("agent", "gen:agent?n={n}", paper="DualMap +125 % (tool&agent)"),
    SuiteWorkload("chat_burst", "gen:chat_burst?n={n}"),
    SuiteWorkload(
        "mooncake",
        "mooncake:{data}/mooncake_synthetic_trace.jsonl",
        trace="mooncake_synthetic_trace.jsonl",
    ),
    SuiteWorkload(
        "azure_conv", "azure:{data}/azure_llm_2023_conv.csv?share=0.3", "azure_llm_2023_conv.csv"
    ),
    SuiteWorkload("tool_use", "gen:tool_use?tools=150&n={n}&rate=56", size=4),
    SuiteWorkload("long_doc_qa", "gen:long_doc_qa?docs=100&n={n}&rate=8", size=4),
    SuiteWorkload("multi_turn", "gen:multi_turn?n={n}&rate=2.4", size=4),
    SuiteWorkload("zipf_hotspot", "gen:zipf_hotspot?n={n}&rate=24", size=4),
    SuiteWorkload("no_sharing", "gen:no_sharing?n={n}&rate=20.8", size=4),
]


@lru_cache(maxsize=4)
def _workload(spec: str, requests: int) -> Workload:
    return load_workload(spec, WorkloadOptions(limit=requests))


def workload_for(w: SuiteWorkload, requests: int) -> Workload:
    n = requests * w.size
    return _workload(w.spec.format(n=n, data=data_dir()), n)


# -- tasks (run in worker processes) ---------------------------------------------------
@dataclass(frozen=True)
class Task:
    preset: str
    workload: SuiteWorkload
    policy: str  # "" = the bounds task
    requests: int
    instances: int
    sq_capacity: float = 0.0
    ttft_only: bool = False


def _summary(run: SimRun) -> dict[str, Any]:
    s = summarize(run)
    return {k: s[k] for k in ("cache_hit_rate", "ttft_p50", "ttft_p99", "goodput")}


def _curve(
    runner: Callable[[Workload, MissBudget | None], SimRun],
    wl: Workload,
    sq_cap: float,
    ttft_only: bool = False,
) -> dict[str, Any]:
    """Attainment at the curve's rates (None: below CURVE_FLOOR, stopped early), and the
    summary at the reference load."""
    out: dict[str, Any] = {"curve": [], "reference": None}
    if sq_cap <= 0 or wl.rate <= 0:
        return out
    for frac in CURVE:
        scaled = wl.scaled(sq_cap * frac / wl.rate)
        if frac == REFERENCE:
            run = runner(scaled, None)
            out["reference"] = _summary(run)
            att: float | None = slo_attainment(run, ttft_only=ttft_only)
        else:
            try:
                budget = MissBudget(len(wl), CURVE_FLOOR, ttft_only=ttft_only)
                att = slo_attainment(runner(scaled, budget), ttft_only=ttft_only)
            except ProbeFailed:
                att = None
        out["curve"].append([sq_cap * frac, att])
    return out


def _saturated(
    runner: Callable[[Workload], SimRun], wl: Workload, capacity: float, ttft_only: bool
) -> bool:
    """Whether the workload still met its SLO at the search's cap (capacity unknown above)."""
    if capacity < wl.rate * CAP / 2:
        return False
    return slo_attainment(runner(wl.scaled(CAP)), ttft_only=ttft_only) >= 0.9


def run_task(task: Task) -> dict[str, Any]:
    t0 = time.perf_counter()
    wl = workload_for(task.workload, task.requests)
    cluster = ClusterSpec(task.instances, load_preset(task.preset))
    out: dict[str, Any] = {"preset": task.preset, "workload": task.workload.name}
    if not task.policy:
        probe = EngineCore("probe", cluster.perf)
        out["reusable"] = cache_hit_upper_bound(
            wl, lambda r: probe.admissible(r.prompt_tokens, r.output_tokens) is None
        )
        out["requests"], out["rate"] = len(wl), wl.rate
        only = task.ttft_only
        sq, sq_runs = shared_queue_capacity(wl, cluster, ttft_only=only)
        pooled, pooled_runs = bound_capacity(wl, cluster, ttft_only=only)
        out["shared_queue"] = {
            "capacity": sq,
            "probes": sq_runs,
            "saturated": _saturated(lambda w: run_shared_queue(w, cluster), wl, sq, only),
            **_curve(lambda w, b: run_shared_queue(w, cluster, budget=b), wl, sq, only),
        }
        out["pooled"] = {
            "capacity": pooled,
            "probes": pooled_runs,
            "saturated": _saturated(lambda w: run_bound(w, cluster), wl, pooled, only),
            **_curve(lambda w, b: run_bound(w, cluster, budget=b), wl, sq, only),
        }
    else:
        start = wl.scaled(0.7 * task.sq_capacity / wl.rate) if task.sq_capacity > 0 else wl
        rel = wl.rate / start.rate
        cap, runs = capacity_search(
            task.policy,
            start,
            cluster,
            bracket=POLICY_BRACKET,
            cap=CAP * rel,
            floor=rel / CAP,
            ttft_only=task.ttft_only,
        )
        out["policy"] = task.policy
        out["capacity"], out["probes"] = cap, runs
        out["saturated"] = _saturated(
            lambda w: run_policy(task.policy, w, cluster), wl, cap, task.ttft_only
        )
        out.update(
            _curve(lambda w, b: run_policy(task.policy, w, cluster, budget=b), wl, task.sq_capacity)
        )
    out["seconds"] = time.perf_counter() - t0
    return out


# -- orchestration -------------------------------------------------------------------
def pool_map(fn: Callable[[T], R], tasks: list[T], jobs: int) -> Iterable[R]:
    """``fn`` over ``tasks`` in ``jobs`` forked worker processes (in this one if ``jobs <= 1``),
    results in completion order."""
    if jobs <= 1:
        for task in tasks:
            yield fn(task)
        return
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(jobs) as pool:
        yield from pool.imap_unordered(fn, tasks)


def run_suite(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    chosen = [w for w in WORKLOADS if not args.workloads or w.name in args.workloads]
    workloads, skipped = [], []
    for w in chosen:
        if w.trace and not (data_dir() / w.trace).is_file():
            skipped.append(f"{w.name}: {data_dir() / w.trace} not found (set KVGATE_DATA)")
        else:
            workloads.append(w)
    policies = args.policies or policy_names()
    results: dict[str, Any] = {"skipped": skipped, "runs": {}, "policies": policies}
    bounds = [
        Task(p, w, "", args.requests, args.instances) for p in args.presets for w in workloads
    ]
    started = time.perf_counter()
    done = 0
    total = len(bounds) * (1 + len(policies))
    for res in pool_map(run_task, bounds, args.jobs):
        done += 1
        results["runs"][(res["preset"], res["workload"])] = res
        say(
            f"[{done}/{total}] {res['preset']} / {res['workload']}: shared-queue "
            f"{res['shared_queue']['capacity']:.2f} req/s, pooled {res['pooled']['capacity']:.2f} "
            f"req/s, reusable {res['reusable']:.0%} ({res['seconds']:.0f} s)"
        )
    by_workload = {w.name: w for w in workloads}
    tasks = [
        Task(
            p,
            by_workload[w],
            pol,
            args.requests,
            args.instances,
            r["shared_queue"]["capacity"],
            args.ttft_only,
        )
        for (p, w), r in results["runs"].items()
        for pol in policies
    ]
    for res in pool_map(run_task, tasks, args.jobs):
        done += 1
        results["runs"][(res["preset"], res["workload"])].setdefault("policies", {})[
            res["policy"]
        ] = res
        say(
            f"[{done}/{total}] {res['preset']} / {res['workload']} / {res['policy']}: "
            f"{res['capacity']:.2f} req/s ({res['probes']} probes, {res['seconds']:.0f} s)"
        )
    results["wall_seconds"] = time.perf_counter() - started
    return results


# -- rendering -----------------------------------------------------------------------
def _cap(entry: Mapping[str, Any]) -> str:
    """A capacity; "≥" when the search stopped at its cap (the workload never saturated)."""
    return f"{'≥ ' if entry.get('saturated') else ''}{entry['capacity']:.2f}"


def _criterion(args: argparse.Namespace) -> str:
    return "TTFT 5 s" if getattr(args, "ttft_only", False) else "TTFT 5 s and TPOT 100 ms"


def _att(a: float | None) -> str:
    return f"<{CURVE_FLOOR:.0%}" if a is None else f"{a:.0%}"


def _r(num: Mapping[str, Any] | None, den: Mapping[str, Any] | None) -> str:
    """Capacity ratio of two entries; a saturated side (capacity only known to be >= its
    value) makes it a lower ("≥") or upper ("≤") bound, or unknown ("sat") when both are."""
    if num is None or den is None:
        return "–"
    text = _x(num["capacity"], den["capacity"])
    hi, lo = bool(num.get("saturated")), bool(den.get("saturated"))
    if hi and lo:
        return "sat"
    return f"≥ {text}" if hi else f"≤ {text}" if lo else text


def _x(num: float | None, den: float | None) -> str:
    if num is None or not den:
        return "–"
    return f"{num / den:.2f}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.0%}"


def _summary_matrix(
    results: Mapping[str, Any], preset: str, workloads: list[SuiteWorkload]
) -> list[str]:
    """Rows = workloads, columns = policies: capacity ÷ the best baseline's, at a glance."""
    names = list(results["policies"])
    out = [
        "Capacity ÷ the best baseline's (baselines: "
        + ", ".join(b for b in BASELINES if b in names)
        + "); last columns: the best baseline and the shared-queue bound, req/s.\n",
        "| workload | " + " | ".join(names) + " | best baseline | SQ bound |",
        "|---|" + "---:|" * (len(names) + 2),
    ]
    for w in workloads:
        r = results["runs"].get((preset, w.name))
        if r is None:
            continue
        pols = r.get("policies", {})
        base = [b for b in BASELINES if b in pols]
        best = max(base, key=lambda b: pols[b]["capacity"]) if base else ""
        den = pols.get(best)
        cells = [_r(pols[n], den) if n in pols else "–" for n in names]
        out.append(
            f"| {w.name} | " + " | ".join(cells) + f" | {best} {_cap(den) if den else '–'} | "
            f"{_cap(r['shared_queue'])} |"
        )
    return [*out, ""]


def render(results: Mapping[str, Any], args: argparse.Namespace) -> str:
    out: list[str] = []
    workloads = [w for w in WORKLOADS if any(k[1] == w.name for k in results["runs"])]
    for preset in args.presets:
        perf = load_preset(preset)
        counts = ", ".join(
            f"{w.name} {results['runs'][(preset, w.name)]['requests']:,}"
            for w in workloads
            if (preset, w.name) in results["runs"]
        )
        out += [
            f"\n### {preset}: {args.instances} engines × {perf.kv_capacity_tokens / 1e6:.2f} M "
            f"tokens of KV; requests: {counts}\n",
            *_summary_matrix(results, preset, workloads),
            f"Capacity (req/s) at which ≥ 90 % meet {_criterion(args)}, ±2 %; ratios to "
            "least_loaded (LL), the best baseline (BB), the shared-queue bound (SQ) and the "
            "pooled bound (PB). Hit rate at the reference load (½ SQ capacity), ÷ the pooled "
            "bound's there.\n",
            "| workload | policy | capacity | ÷ LL | ÷ BB | ÷ SQ | ÷ PB | hit (÷ PB's) | s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        curves = ["", f"Attainment curve, {preset} (rates as fractions of SQ capacity):\n"]
        curves += ["| workload | policy | " + " | ".join(f"{f:.0%}" for f in CURVE) + " |"]
        curves += ["|---|---|" + "---:|" * len(CURVE)]
        for w in workloads:
            r = results["runs"].get((preset, w.name))
            if r is None:
                continue
            pols: dict[str, Any] = r.get("policies", {})
            sq, pb = r["shared_queue"], r["pooled"]
            ll = pols.get("least_loaded")
            base = [pols[b] for b in BASELINES if b in pols]
            best = max(base, key=lambda e: e["capacity"]) if base else None
            pb_ref = (r["pooled"].get("reference") or {}).get("cache_hit_rate")
            spent = r["seconds"] + sum(p["seconds"] for p in pols.values())
            label = f"**{w.name}** (reusable {r['reusable']:.0%}"
            label += f"; {w.paper})" if w.paper else ")"
            for name, p in pols.items():
                hit = (p.get("reference") or {}).get("cache_hit_rate")
                out.append(
                    f"| {label} | {name} | {_cap(p)} | {_r(p, ll)} | {_r(p, best)} | "
                    f"{_r(p, sq)} | {_r(p, pb)} | {_pct(hit)} ({_x(hit, pb_ref)}) | "
                    f"{p['seconds']:.0f} |"
                )
                curves.append(
                    f"| {w.name} | {name} | "
                    + " | ".join(_att(a) for _, a in p.get("curve", []))
                    + " |"
                )
                label = ""
            for key, title in (("shared_queue", "*shared-queue bound*"), ("pooled", "*pooled*")):
                b = r[key]
                hit = (b.get("reference") or {}).get("cache_hit_rate")
                out.append(
                    f"| {label} | {title} | {_cap(b)} | {_r(b, ll)} | {_r(b, best)} | "
                    f"{_r(b, sq)} | {_r(b, pb)} | {_pct(hit)} | {r['seconds']:.0f} |"
                )
                curves.append(
                    f"| {w.name} | {title} | "
                    + " | ".join(_att(a) for _, a in b.get("curve", []))
                    + " |"
                )
                label = ""
            out.append(f"| | *{w.name} total* | | | | | | | {spent:.0f} |")
        out += curves
    for note in results["skipped"]:
        out.append(f"\n_skipped {note}_")
    out.append(
        f"\n_{len(results['runs'])} preset × workload pairs, {len(results['policies'])} "
        f"policies, {args.jobs} job(s): {results['wall_seconds']:.0f} s wall_"
    )
    return "\n".join(out)


def merge_saved(saved: list[dict[str, Any]]) -> dict[str, Any]:
    """Results saved by ``--json``, merged in order: a later run's bounds and policy results
    replace an earlier one's for the same preset and workload (re-running one policy)."""
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    policies: list[str] = []
    skipped: list[str] = []
    wall = 0.0
    for raw in saved:
        for r in raw["runs"]:
            key = (r["preset"], r["workload"])
            merged = {**runs.get(key, {}), **{k: v for k, v in r.items() if k != "policies"}}
            merged["policies"] = {**runs.get(key, {}).get("policies", {}), **r.get("policies", {})}
            runs[key] = merged
        policies += [p for p in raw["policies"] if p not in policies]
        skipped += [s for s in raw.get("skipped", []) if s not in skipped]
        wall += raw.get("wall_seconds", 0.0)
    return {"runs": runs, "policies": policies, "skipped": skipped, "wall_seconds": wall}


def _names(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def main(argv: list[str]) -> int:
    ap = benchmark_parser(__doc__, "benchmarks.quality.evaluate suite")
    ap.add_argument("--presets", type=_names, default=PRESETS)
    ap.add_argument("--workloads", type=_names, default=[])
    ap.add_argument("--policies", type=_names, default=[])
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", default="", help="also write the raw results here")
    ap.add_argument(
        "--from-json",
        default="",
        help="only render results saved by --json; several files (a,b) merge, a later file's "
        "policy results replacing an earlier one's",
    )
    ap.add_argument(
        "--ttft-only", action="store_true", help="capacity on the TTFT target alone (DualMap's)"
    )
    args = ap.parse_args(argv)
    if args.from_json:
        print(
            render(
                merge_saved([json.loads(Path(f).read_text()) for f in _names(args.from_json)]), args
            )
        )
        return 0
    unknown = [w for w in args.workloads if w not in {x.name for x in WORKLOADS}]
    unknown += [p for p in args.policies if p not in policy_names()]
    if unknown:
        ap.error(f"unknown workload(s)/policy(ies): {', '.join(unknown)}")

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results = run_suite(args, say)
    print(render(results, args))
    if args.json:
        raw = {**results, "runs": [v for v in results["runs"].values()]}
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
