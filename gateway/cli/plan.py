"""``kvgate plan``: the smallest pool per policy that meets an SLO attainment target."""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any

from gateway.cli.simulate import (
    add_workload_args,
    apply_lora_args,
    check_policy_names,
    load_cli_workload,
    parse_policy_options,
    progress_printer,
    workload_line,
)
from gateway.core.errors import ConfigError
from gateway.perfmodel.presets import load_preset
from gateway.policies.registry import POLICIES, create_policy
from gateway.sim.planner import PlanOptions, PlanResult, plan
from gateway.sim.plots import plots_available, write_plan_plot


@functools.cache
def _pd_native(name: str) -> bool:
    return bool(create_policy(name).pd_native)


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "plan",
        help="find the smallest pool per policy that meets an SLO attainment target",
        description=(
            "Simulate the workload on growing pools (exponential, then binary search) and "
            "report, per policy, the fewest engines at which --attainment of the requests "
            "meet their SLO, beside the pooled bound's pool size."
        ),
    )
    add_workload_args(p)
    p.add_argument(
        "--attainment",
        type=float,
        default=0.9,
        metavar="F",
        help="share of requests that must meet their SLO, in (0, 1] (default 0.9)",
    )
    rate = p.add_mutually_exclusive_group()
    rate.add_argument(
        "--rate", type=float, default=None, metavar="R", help="scale arrivals to R req/s on average"
    )
    rate.add_argument(
        "--rate-scale", type=float, default=None, metavar="X", help="arrivals X times faster"
    )
    unified = [n for n in POLICIES if not _pd_native(n)]
    p.add_argument(
        "--policies",
        default=None,
        metavar="P1,P2,...",
        help=f"policies to plan for (default: {', '.join(unified)})",
    )
    p.add_argument(
        "--max-instances", type=int, default=64, metavar="N", help="largest pool tried (64)"
    )
    p.add_argument(
        "--pd",
        action="store_true",
        help="also search disaggregated pools (and their prefill/decode split) for the "
        "policies that place both legs (cost_model, length_heuristic)",
    )
    p.add_argument(
        "--kv-bandwidth", type=float, default=25.0, metavar="GBPS", help="P/D KV bandwidth (25)"
    )
    p.add_argument("--out", default=None, metavar="DIR", help="write results.json and plan.png")
    p.set_defaults(handler=run)


def _policies(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(unified policies, policies also searched disaggregated)."""
    given = args.policies is not None
    names = [p.strip() for p in (args.policies or "").split(",") if p.strip()]
    if given and not names:
        raise ConfigError("--policies is empty")
    check_policy_names(names)
    if not given:
        names = [n for n in POLICIES if not _pd_native(n)]
    pd: list[str] = []
    if args.pd:
        pd = [n for n in (names if given else POLICIES) if _pd_native(n)]
        if not pd:
            native = ", ".join(n for n in POLICIES if _pd_native(n))
            raise ConfigError(f"--pd needs a policy that places both legs ({native})")
        if given:
            names = [n for n in names if n not in pd]
    return names, pd


def _check(args: argparse.Namespace) -> None:
    for name in ("ttft_slo", "tpot_slo", "rate", "rate_scale", "limit", "kv_bandwidth"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if not 0 < args.attainment <= 1:
        raise ConfigError(f"--attainment must be in (0, 1], got {args.attainment}")
    if args.max_instances < (2 if args.pd else 1):
        raise ConfigError(f"--max-instances must be at least {2 if args.pd else 1}")


def run(args: argparse.Namespace) -> int:
    _check(args)
    names, pd = _policies(args)
    policy_options = parse_policy_options(args.policy_option, [*names, *pd])
    for name in (*names, *pd):  # fail on bad knobs before loading a large trace
        create_policy(name, options=policy_options.get(name))
    perf = apply_lora_args(load_preset(args.preset), args)
    say = progress_printer(args.quiet)
    started = time.perf_counter()
    workload = load_cli_workload(args, perf.block_size)
    if args.rate is not None or args.rate_scale is not None:
        if workload.rate <= 0:
            raise ConfigError("cannot scale the arrival rate of a workload of one instant")
        factor = args.rate / workload.rate if args.rate is not None else args.rate_scale
        workload = workload.scaled(factor)
    say(workload_line(args.workload, workload, started))
    opts = PlanOptions(
        policies=names,
        perf=perf,
        target=args.attainment,
        max_instances=args.max_instances,
        pd=pd,
        seed=args.seed,
        kv_bandwidth_gbps=args.kv_bandwidth,
        policy_options=policy_options,
    )
    result = plan(workload, opts, progress=say, clock=time.perf_counter)
    doc: dict[str, Any] = {
        "workload": args.workload,
        "requests": len(workload),
        "rate_rps": workload.rate,
        "preset": args.preset,
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
        "attainment_target": args.attainment,
        "max_instances": args.max_instances,
        "seed": args.seed,
        **result.to_json(),
    }
    print(render_table(doc, result))
    if args.out is not None:
        _write(Path(args.out), doc, result, say)
    say(f"planned in {time.perf_counter() - started:.1f} s")
    return 0


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "–"
    if kind == "pct":
        return f"{value:.1%}"
    return f"{value:.3f}"


def render_table(doc: dict[str, Any], result: PlanResult) -> str:
    """The Markdown summary printed on stdout."""
    max_n = doc["max_instances"]
    lines = [
        f"Smallest pool meeting TTFT <= {doc['slo']['ttft_s']:g} s and TPOT <= "
        f"{doc['slo']['tpot_s']:g} s for >= {doc['attainment_target']:.0%} of requests "
        f"({doc['requests']} requests, {doc['rate_rps']:.2f} req/s, preset {doc['preset']}):",
        "",
        "| policy | smallest pool | attainment | TTFT p50 | TTFT p99 | hit rate | "
        "bound pool / pool | simulations |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in [("pooled bound", doc["bound"]), *doc["policies"].items()]:
        pool = row["pool"]
        cell = f"> {max_n}" if pool is None else str(pool)
        if row["prefill_instances"]:
            cell += f" ({row['prefill_instances']}P+{pool - row['prefill_instances']}D)"
        lines.append(
            f"| {label} | {cell} | {_fmt(row['attainment'], 'pct')} | "
            f"{_fmt(row['ttft_p50'], 's')} | {_fmt(row['ttft_p99'], 's')} | "
            f"{_fmt(row['cache_hit_rate'], 'pct')} | {_fmt(row['bound_fraction'], 'pct')} | "
            f"{row['simulations']} |"
        )
    rec = result.recommended
    lines.append("")
    if rec is None:
        lines.append(f"No policy meets the target with up to {max_n} engines.")
    else:
        pool = doc["policies"][rec]["pool"]
        lines.append(f"Recommended: {rec} ({pool} engines).")
    return "\n".join(lines)


def _write(out: Path, doc: dict[str, Any], result: PlanResult, say: Any) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        if plots_available():
            curves = {
                row.label: [(n, p.attainment) for n, p in _by_size(row).items()]
                for row in [result.bound, *result.rows]
            }
            write_plan_plot(curves, doc["attainment_target"], out / "plan.png")
            say(f"wrote {out}/results.json and {out}/plan.png")
        else:
            say("matplotlib is not installed: skipping plan.png (pip install 'kvgate[plots]')")
    except OSError as exc:
        raise ConfigError(f"cannot write to {out}: {exc.strerror}") from None


def _by_size(row: Any) -> dict[int, Any]:
    """Attainment per pool size: the probe itself, or the best split for P/D rows."""
    if row.disaggregated:
        return dict(row.by_size)
    return {p.instances: p for p in row.probes}
