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
# reports what this platform reaches and why): measured here, with the frontend and wake
# terms, 28-56 % for client-side TTFT, 5-35 % for client-side E2E, 34-51 % / 4-35 % for the
# engine-side TTFT / E2E means (load average ~10; before those terms, on a quieter machine:
# 56-69 %, 23-34 %, 37-41 % / 17-28 %). A broken model (say, a decode step fitted 100x too
# small) lands far outside them.
MAX_ERROR = {
    "ttft_p50": 0.85,
    "ttft_p90": 0.85,
    "e2e_mean": 0.5,
    "engine_ttft_mean": 0.6,
    "engine_e2e_mean": 0.45,
}


def violations(rows: list[Row]) -> list[str]:
    return [
        f"{row.policy} {key}: error {row.error(key):.0%} > {bound:.0%}"
        for row in rows
        for key, bound in MAX_ERROR.items()
        if row.error(key) > bound
    ]


def test_calibrated_simulator_predicts_real_latencies(fleet: Fleet, tmp_path: Path) -> None:
    profile = calibrate(fleet.unified[0].url, tmp_path / "profile.yaml", max_seconds=90)
    perf = load_preset(str(profile))
    assert perf.block_size == 32 and perf.prefill_b > 0 and perf.decode_e0 > 0
    # the API process and HTTP path add milliseconds (5-9 ms measured direct, load 9)
    assert perf.frontend_ms > 0
    urls = [e.url for e in fleet.unified]
    # Latencies of CPU engines on a 2-core machine swing with anything else running on it, so
    # a run outside the bounds is replayed once (new prompts, same profile) before failing.
    tables = []
    for attempt in range(2):
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
