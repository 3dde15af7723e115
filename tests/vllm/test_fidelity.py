"""Calibration on a real engine, then simulator fidelity against kvgate + real engines."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import MODEL, Fleet, start_gateway
from fidelity_lib import CHAT, PREFILL, Row, calibrate, measure, table

from gateway.config import PolicyConfig
from gateway.perfmodel.presets import load_preset

pytestmark = pytest.mark.vllm

# Stated bounds on the relative prediction error, per workload (the target is 20 %;
# docs/evaluation.md reports what this platform reaches and why). The chat rows (short,
# mostly cached prompts, 30 requests at 3 req/s, round_robin and the default policy) are
# dominated by fixed per-request and per-token costs, and inside the full tier (five engines
# on two cores) they err 24-35 % on E2E where two engines alone err 1-14 %
# (`benchmarks.fidelity.vllm_cpu [--tier-engines]`; why is not isolated): their TTFT bounds
# are loose, their E2E bound catches a decode model at half its size. The prefill row
# (1-2k-token prompts, 20 at 1.5 req/s, round_robin) is prefill-bound: its TTFT bounds catch
# a prefill model at half its size. Measured with `.venv/bin/python -m pytest -m vllm
# tests/vllm/test_fidelity.py -s`; the numbers and the mutations that fail the bounds are in
# docs/evaluation.md. A run outside them is replayed up to twice.
ATTEMPTS = 3
MAX_ERROR = {
    "chat": {
        "ttft_p50": 0.6,
        "ttft_p90": 0.75,
        "e2e_mean": 0.4,
        "engine_ttft_mean": 0.6,
        "engine_e2e_mean": 0.4,
    },
    "prefill": {
        "ttft_p50": 0.4,
        "ttft_p90": 0.55,
        "e2e_mean": 0.45,
        "engine_ttft_mean": 0.4,
        "engine_e2e_mean": 0.45,
    },
}
ROWS = (
    ("round_robin", CHAT, 30, 3.0),
    (PolicyConfig().name, CHAT, 30, 3.0),  # the default policy
    ("round_robin", PREFILL, 20, 1.5),
)
"""(policy, workload, requests, rate) of each row of an attempt."""


def violations(rows: list[Row]) -> list[str]:
    return [
        f"{row.policy} {row.workload} {key}: error {row.error(key):.0%} > {bound:.0%}"
        for row in rows
        for key, bound in MAX_ERROR[row.workload].items()
        if row.error(key) > bound
    ]


def test_calibrated_simulator_predicts_real_latencies(fleet: Fleet, tmp_path: Path) -> None:
    """Errors within ``MAX_ERROR`` for every row of one attempt (of ``ATTEMPTS``)."""
    # The NIXL prefill/decode engines' UCX progress thread polls without pause (97 % of a core
    # each, measured idle): running, they take about half of each core from the engines under
    # test (real E2E 500 ms instead of 200 ms, the same requests), at normal or idle priority
    # alike. They are paused for the calibration and the replays.
    with fleet.prefill.paused(), fleet.decode.paused():
        run_fidelity(fleet, tmp_path)


def run_fidelity(fleet: Fleet, tmp_path: Path) -> None:
    profile = calibrate(fleet.unified[0].url, tmp_path / "profile.yaml", max_seconds=90)
    perf = load_preset(str(profile))
    assert perf.block_size == 32 and perf.prefill_b > 0 and perf.decode_e0 > 0
    # the API process and HTTP path add milliseconds (5-9 ms measured direct, load 9)
    assert perf.frontend_ms > 0
    urls = [e.url for e in fleet.unified]
    # Latencies of CPU engines on a 2-core machine swing with anything else running on it, so
    # a run outside the bounds is replayed up to twice (new prompts, same profile) before failing.
    tables = []
    for attempt in range(ATTEMPTS):
        rows = []
        for policy, shape, n, rate in ROWS:
            args = ["--policy", policy]
            for url in urls:
                args += ["--engine", url]
            gw = start_gateway(tmp_path, args)
            try:
                sessions = [e.proc.pid for e in fleet.unified]
                rows.append(
                    measure(
                        gw.url,
                        urls,
                        MODEL,
                        policy,
                        profile,
                        n=n,
                        rate=rate,
                        seed=attempt,
                        shape=shape,
                        sessions=sessions,
                    )
                )
            finally:
                gw.stop()
        tables.append(table(rows))
        print(f"\nattempt {attempt + 1}\n" + tables[-1])
        if not violations(rows):
            return
    pytest.fail(
        "simulator fidelity outside the stated bounds:\n"
        + "\n\n".join(tables)
        + "\n"
        + "\n".join(violations(rows))
    )
