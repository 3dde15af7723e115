"""Flow control at 1.5x capacity: does interactive stay fast, batch get served, and the
flooding tenant not crowd out the others? And does the simulator agree?

Two emulated engines (preset mistral-7b-a6000, real time, in process) behind the gateway
(policy least_loaded, ``flow_control`` at its shipped defaults, ``benchmarks/flow/harness.py``:
FLOW, or as ``--max-ttft`` and ``--protect-ttft`` set it); 1,000-token
unique prompts, one output token each (latency = TTFT). First an unloaded run (interactive
only, 3 req/s), then the loaded one: ``--rate`` req/s (default 26, about 1.5x the two
engines' ~17.8 req/s) for ``--seconds``, 20 % interactive (priority 0), 80 % batch
(priority 10), three tenants with weights 1:1:10 (the third floods). The simulator runs
the same arrivals and the same flow-control settings.

Printed, with targets:
  interactive TTFT p99 loaded / unloaded    <= 2x        (gateway; the simulator's too)
  batch served by the end of the run        >= 90 %
  Jain's index of the tenants' served work  >= 0.9       (each tenant's prompt tokens served
                                                          while arrivals last, over its max-min
                                                          fair share of what was served)
  lost                                      = 0          (neither 200 nor 429/503 with
                                                          Retry-After, or no answer)
  simulator / gateway interactive p99       within 20 %
``--no-flow`` adds the same loaded run with flow control off; ``--sweep-max-ttft 2,0.5``
prints only the simulator's loaded run for each ``max_ttft_s`` (``--sweep-protect-ttft``: for
each ``protect_ttft_s``, the limit while priorities are mixed; 0 turns it off).
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess

from benchmarks.common import benchmark_parser
from benchmarks.flow.harness import FLOW, Scenario, Summary, run_live, run_sim, summarize


def _row(name: str, s: Summary) -> str:
    batch = "-" if math.isnan(s.batch_served) else f"{s.batch_served * 100:.1f}"
    jain = "-" if math.isnan(s.batch_served) else f"{s.jain:.3f}"  # unloaded: no contention
    return (
        f"{name:<24} {s.interactive_p99 * 1000:>11.0f} {batch:>8} "
        f"{jain:>6} {s.lost:>5} {s.refused:>8} {s.refused_without_retry_after:>9}"
    )


def sweep(loaded: Scenario, key: str, values: str, flag: str, extra: str) -> None:
    """The simulator's loaded run for each value of the ``flow_control`` setting ``key``
    (everything else as ``loaded.flow``)."""
    arrivals = loaded.arrivals()
    print(f"simulator, {len(arrivals)} requests at {loaded.rate:g} req/s, {loaded.flow}")
    print(f"{key:>14} {'int. p99 ms':>11} {'batch %':>8} {'Jain':>6}")
    for value in values.split(","):
        flow = {**loaded.flow, key: float(value)}
        s = summarize(run_sim(loaded, arrivals, flow), loaded.seconds)
        print(
            f"{float(value):>14g} {s.interactive_p99 * 1000:>11.0f} "
            f"{s.batch_served * 100:>8.1f} {s.jain:>6.3f}"
        )
    print(f"\n(python -m benchmarks.flow.overload{extra} {flag} {values})")


def main() -> None:
    ap = benchmark_parser(__doc__, "benchmarks.flow.overload")
    ap.add_argument("--seconds", type=float, default=8.0, help="arrivals last this long")
    ap.add_argument("--rate", type=float, default=26.0, help="requests per second (loaded)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-flow", action="store_true", help="also run with flow control off")
    ap.add_argument("--max-ttft", type=float, default=None, help="flow_control.max_ttft_s")
    ap.add_argument(
        "--protect-ttft", type=float, default=None, help="flow_control.protect_ttft_s (0: off)"
    )
    ap.add_argument(
        "--sweep-max-ttft",
        default="",
        help="comma-separated max_ttft_s values: only the simulator's loaded run for each",
    )
    ap.add_argument(
        "--sweep-protect-ttft",
        default="",
        help="comma-separated protect_ttft_s values: only the simulator's loaded run for each",
    )
    args = ap.parse_args()
    flow = dict(FLOW)
    if args.max_ttft is not None:
        flow["max_ttft_s"] = args.max_ttft
    if args.protect_ttft is not None:
        flow["protect_ttft_s"] = args.protect_ttft
    extra = "".join(
        f" {flag} {value:g}"
        for flag, value in (("--max-ttft", args.max_ttft), ("--protect-ttft", args.protect_ttft))
        if value is not None
    )
    for key, values, flag in (
        ("max_ttft_s", args.sweep_max_ttft, "--sweep-max-ttft"),
        ("protect_ttft_s", args.sweep_protect_ttft, "--sweep-protect-ttft"),
    ):
        if values:
            scenario = Scenario(seconds=args.seconds, rate=args.rate, seed=args.seed, flow=flow)
            sweep(scenario, key, values, flag, extra)
            return
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"load average {os.getloadavg()[0]:.1f}, commit {commit or 'unknown'}")
    print(f"flow_control: {flow or 'the shipped defaults'}")
    idle = Scenario(seconds=4.0, rate=3.0, interactive=1.0, seed=args.seed, flow=flow)
    idle_arrivals = idle.arrivals()
    loaded = Scenario(seconds=args.seconds, rate=args.rate, seed=args.seed, flow=flow)
    arrivals = loaded.arrivals()
    runs: list[tuple[str, Summary]] = [
        ("gateway unloaded", summarize(asyncio.run(run_live(idle, idle_arrivals)), idle.seconds)),
        ("simulator unloaded", summarize(run_sim(idle, idle_arrivals), idle.seconds)),
        ("gateway 1.5x", summarize(asyncio.run(run_live(loaded, arrivals)), loaded.seconds)),
        ("simulator 1.5x", summarize(run_sim(loaded, arrivals), loaded.seconds)),
    ]
    if args.no_flow:
        off = {**loaded.flow, "enabled": False}
        live_off = asyncio.run(run_live(loaded, arrivals, off))
        runs.append(("gateway 1.5x, flow off", summarize(live_off, loaded.seconds)))
        runs.append(
            ("simulator 1.5x, flow off", summarize(run_sim(loaded, arrivals, off), loaded.seconds))
        )
    print(f"{len(arrivals)} requests loaded, {len(idle_arrivals)} unloaded")
    print(
        f"{'run':<24} {'int. p99 ms':>9} {'batch %':>8} {'Jain':>6} {'lost':>5} "
        f"{'refused':>8} {'no R-A':>9}"
    )
    for name, s in runs:
        print(_row(name, s))
    by = dict(runs)
    ratio = by["gateway 1.5x"].interactive_p99 / by["gateway unloaded"].interactive_p99
    sim_ratio = by["simulator 1.5x"].interactive_p99 / by["simulator unloaded"].interactive_p99
    agree = by["simulator 1.5x"].interactive_p99 / by["gateway 1.5x"].interactive_p99
    g = by["gateway 1.5x"]
    checks = [
        ("interactive p99 loaded/unloaded (gateway)", f"{ratio:.2f}x", ratio <= 2.0, "<= 2x"),
        (
            "interactive p99 loaded/unloaded (simulator)",
            f"{sim_ratio:.2f}x",
            sim_ratio <= 2.0,
            "<= 2x",
        ),
        (
            "batch served by the end",
            f"{g.batch_served * 100:.1f} %",
            g.batch_served >= 0.9,
            ">= 90 %",
        ),
        ("Jain's index across tenants", f"{g.jain:.3f}", g.jain >= 0.9, ">= 0.9"),
        (
            "lost",
            str(g.lost + g.refused_without_retry_after),
            g.lost == 0 and not g.refused_without_retry_after,
            "= 0",
        ),
        (
            "simulator / gateway interactive p99",
            f"{agree:.2f}",
            abs(agree - 1) <= 0.2,
            "within 20 %",
        ),
    ]
    print()
    for name, value, ok, target in checks:
        print(f"{name:<46} {value:>10}  target {target:<12} {'met' if ok else 'MISSED'}")
    print(
        f"\n(python -m benchmarks.flow.overload --seconds {args.seconds:g} "
        f"--rate {args.rate:g}{extra})"
    )


if __name__ == "__main__":
    main()
