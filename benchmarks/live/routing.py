"""Live routing benchmark: kvgate's policies in front of 4 emulated engines, real processes.

Workloads (see ``benchmarks.live.workloads``), all ``/v1/completions`` streams of the official
``openai`` client, open loop:

* ``shared`` — 8 system prompts of 1,500 tokens, Zipf(1.0) popularity, each followed by a
  unique 100-token question; 32 output tokens; Poisson at ``--load`` (0.7) of the no-reuse
  capacity;
* ``unique`` — the same sizes and rate, every prompt unique;
* ``chat`` — the first ``--chat-requests`` (300) requests of ``--chat-spec`` (``gen:chat``),
  block structure turned into text, arrivals rescaled to ``--load`` of the 4 engines' no-reuse
  capacity for those requests.

The no-reuse capacity is computed from the engine model the emulators run (the preset with
``--kv-blocks``): every request given to one model engine at t=0 without prefix hashes,
requests / makespan. Engines have ``--kv-blocks`` (300) blocks of 16 tokens, so one holds three
of the eight prefixes at most; ``chat`` engines get ``--chat-kv-blocks`` (the preset's). Every
(policy, workload) run starts fresh engines (empty caches) and a fresh router. Engines run at
``--time-scale`` (2; ``chat``: ``--chat-time-scale``, 1) real seconds per model second; TTFTs
are printed in model milliseconds (wall / time scale). Hit rate and request shares are the
engines' own ``vllm:*`` counters; ``overhead`` is the client's mean TTFT minus the engines' own.
Targets (issue 13): shared TTFT p50 <= 25 ms, p99 <= 200 ms, busiest engine <= 30 %, hit rate
>= 0.85; unique TTFT p99 <= round robin's (its unique run is added when not selected).

``--sessions`` sends an ``x-session-id`` with each shared and unique request: ``prompt`` one
session per system prompt, ``agents`` four per system prompt, ``random`` 16 drawn at random
(unique prompts: 16 at random for any of them); ``none`` (default) sends none.

    python -m benchmarks.live.routing [--policies a,b] [--workloads shared,unique,chat]
        [--policy-option K=V] [--repeat 2] [--external-router CMD] [--json FILE]
        [--sessions none|prompt|agents|random]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.common import benchmark_parser
from benchmarks.live.report import print_spread, print_table, print_targets
from benchmarks.live.run import Row, Setup, run_one, verify_kv
from benchmarks.live.workloads import SharedPrefixShape
from gateway.bench.loadgen import ReplayRequest
from gateway.policies.registry import policy_names
from gateway.sim.workloads import WorkloadError

WORKLOADS = ("shared", "unique", "chat")
SESSIONS = ("none", "prompt", "agents", "random")
EXTERNAL = "external"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, "benchmarks.live.routing")
    p.add_argument("--policies", default=",".join(policy_names()), help="comma list (all)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list (%(default)s)")
    p.add_argument("--engines", type=int, default=4, help="emulated engines (%(default)s)")
    p.add_argument("--preset", default="llama3-8b-h100", help="engine preset (%(default)s)")
    p.add_argument("--kv-blocks", type=int, default=300, help="KV blocks per engine (300)")
    p.add_argument("--time-scale", type=float, default=2.0, help="wall s per model s (2)")
    p.add_argument("--load", type=float, default=0.7, help="share of no-reuse capacity (0.7)")
    p.add_argument("--shared-requests", type=int, default=400, help="workload A size (400)")
    p.add_argument("--unique-requests", type=int, default=300, help="workload B size (300)")
    p.add_argument("--chat-spec", default="gen:chat", help="workload C spec (gen:chat)")
    p.add_argument("--chat-requests", type=int, default=300, help="workload C size (300)")
    p.add_argument("--chat-kv-blocks", type=int, default=None, help="C's KV blocks (preset)")
    p.add_argument("--chat-time-scale", type=float, default=1.0, help="C's time scale (1)")
    p.add_argument("--chat-max-output", type=int, default=None, help="cap C's outputs")
    p.add_argument(
        "--policy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to every kvgate serve (repeatable; for tuning one policy)",
    )
    p.add_argument("--reference", default="round_robin", help="unique-p99 reference policy")
    p.add_argument(
        "--external-router",
        default=None,
        metavar="CMD",
        help="router command; {port}, {workers} (URLs as arguments), {workers_csv} are filled in",
    )
    p.add_argument("--external-name", default="external", help="its row's name")
    p.add_argument("--repeat", type=int, default=1, help="runs of everything (%(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (%(default)s)")
    p.add_argument(
        "--sessions", choices=SESSIONS, default="none", help="x-session-id scheme (none)"
    )
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    p.add_argument("--keep-logs", action="store_true", help="keep process logs (printed path)")
    args = p.parse_args(argv)
    args.policies = [x for x in args.policies.split(",") if x]  # "" with --external-router
    args.workloads = [x for x in args.workloads.split(",") if x]
    unknown = [x for x in args.policies if x not in policy_names()]
    unknown += [x for x in args.workloads if x not in WORKLOADS]
    if unknown:
        p.error(
            f"unknown policy or workload: {', '.join(unknown)} (policies: "
            f"{', '.join(policy_names())}; workloads: {', '.join(WORKLOADS)})"
        )
    if args.repeat < 1 or args.engines < 1 or not args.load > 0:
        p.error("--repeat and --engines must be >= 1 and --load > 0")
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(router, workload) runs of one repetition, in order."""
    routers = list(args.policies) + ([args.external_name] if args.external_router else [])
    runs = [(r, w) for r in routers for w in args.workloads]
    if "unique" in args.workloads and args.reference not in routers:
        runs.insert(0, (args.reference, "unique"))
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = SharedPrefixShape()
    try:
        setup = Setup.build(args, shape)
    except (WorkloadError, ValueError) as exc:
        print(f"live_routing: workload C: {exc}", file=sys.stderr)
        return 2
    if args.sessions != "none":
        for name in ("shared", "unique"):
            setup.requests[name] = with_sessions(setup.requests[name], args.sessions, args.seed)
        print(f"  sessions: {args.sessions} (x-session-id on shared and unique requests)")
    setup.describe()
    runs = plan(args)
    expect = sum(setup.wall_estimate(w) for _, w in runs) * args.repeat
    print(f"  {len(runs) * args.repeat} runs, expected ~{expect / 60:.0f} min", flush=True)
    logroot = Path(tempfile.mkdtemp(prefix="live_routing-"))
    print(f"verifying engine KV size ({args.kv_blocks} blocks) ...", flush=True)
    print("  " + verify_kv(logroot / "verify", setup), flush=True)
    rows: list[Row] = []
    failed: list[str] = []
    t0 = time.monotonic()
    for rep in range(args.repeat):
        for router, workload in runs:
            external = args.external_router if router == args.external_name else None
            logdir = logroot / f"r{rep}-{router}-{workload}"
            try:
                added = router == args.reference and router not in args.policies
                options: list[str] | None = [] if added else None  # no options for the ref
                row = run_one(
                    logdir, setup, router, workload, external=external, rep=rep, options=options
                )
            except Exception as exc:  # one broken run must not lose the others
                failed.append(f"[{rep + 1}] {router} {workload}: {exc}"[:2000])
                print("  FAILED " + failed[-1], flush=True)
                continue
            rows.append(row)
            print("  " + row.line(), flush=True)
            if args.json:
                write_json(args.json, setup, rows)
    elapsed = time.monotonic() - t0
    la = os.getloadavg()
    print(
        f"\n{len(rows)} runs in {elapsed / 60:.1f} min; load average now "
        f"{la[0]:.2f} {la[1]:.2f} {la[2]:.2f} ({os.cpu_count()} CPUs)"
    )
    for rep in range(args.repeat):
        title = f"run {rep + 1} of {args.repeat}"
        print_table([r for r in rows if r.rep == rep], title=title, default=default_policy())
    if args.repeat > 1:
        print_spread(rows)
    print_targets(rows, reference=args.reference)
    for line in failed:
        print("FAILED " + line)
    if args.json:
        print(f"rows written to {args.json}")
    if args.keep_logs or failed:
        print(f"logs in {logroot}")
    else:
        shutil.rmtree(logroot, ignore_errors=True)
    return 1 if failed else 0


def with_sessions(reqs: list[ReplayRequest], scheme: str, seed: int) -> list[ReplayRequest]:
    """``reqs`` with session ids by ``scheme`` (see the module docstring)."""
    rng = random.Random(f"{seed}:sessions:{scheme}")
    out = []
    for r in reqs:
        found = re.match(r"System prompt (\d+)\.", r.prompt)
        if found is None or scheme == "random":
            session = f"r{rng.randrange(16)}"
        elif scheme == "prompt":
            session = f"p{found.group(1)}"
        else:
            session = f"p{found.group(1)}-{rng.randrange(4)}"
        out.append(replace(r, session=session))
    return out


def default_policy() -> str:
    """The policy ``kvgate serve`` uses when none is named."""
    from gateway.config import Settings

    return str(Settings().policy.name)


def write_json(path: Path, setup: Setup, rows: list[Row]) -> None:
    doc = {"setup": setup.summary(), "rows": [asdict(r) for r in rows]}
    path.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
