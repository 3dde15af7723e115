"""Calibration on a real engine, then simulator fidelity against kvgate + real engines."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import MODEL, Fleet, start_gateway
from fidelity_lib import Row, calibrate, measure, table

from gateway.config import PolicyConfig
from gateway.perfmodel.presets import load_preset

pytestmark = pytest.mark.vllm

# Stated bounds on the relative prediction error (the target is 20 %; docs/evaluation.md
# reports what this platform reaches and why). Measured with
# `.venv/bin/python -m pytest -m vllm tests/vllm/test_fidelity.py -s` at code b4baf07 on a
# quiet machine (three attempts, round_robin / predicted_ttft, other processes on 9-12 % of
# the engines' cores): client-side TTFT p50 50-59 %, p90 51-68 %, E2E mean 30-42 %;
# engine-side TTFT mean 42-57 %, E2E mean 28-41 %, the simulator faster every time (the
# engines ran decode steps of ~10 ms in the replays where calibration measured ~6 ms; why is
# not known). Bounds: about 15 points above the worst of those; a decode step fitted at half
# its size fails them (E2E errors 61-69 % measured); a prefill model at half its size passes
# (TTFT p50 51-53 %). A run outside them is replayed up to twice.
ATTEMPTS = 3
MAX_ERROR = {
    "ttft_p50": 0.75,
    "ttft_p90": 0.85,
    "e2e_mean": 0.6,
    "engine_ttft_mean": 0.75,
    "engine_e2e_mean": 0.6,
}


def violations(rows: list[Row]) -> list[str]:
    return [
        f"{row.policy} {key}: error {row.error(key):.0%} > {bound:.0%}"
        for row in rows
        for key, bound in MAX_ERROR.items()
        if row.error(key) > bound
    ]


def test_calibrated_simulator_predicts_real_latencies(fleet: Fleet, tmp_path: Path) -> None:
    """Errors within ``MAX_ERROR``: measured at b4baf07, TTFT p50 50-59 %, p90 51-68 %, E2E
    30-42 %, engine-side TTFT 42-57 % and E2E 28-41 % (bounds 75 / 85 / 60 / 75 / 60 %)."""
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
        for policy in ("round_robin", PolicyConfig().name):  # and the default policy
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
                        n=30,
                        rate=3.0,
                        seed=attempt,
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
