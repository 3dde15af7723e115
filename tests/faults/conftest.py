"""The fault suite's processes, started once per session, and its results table."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
from faultkit import HEALTH, RESULTS, Fleet, engine, gateway

STRICT_HEALTH = {
    **HEALTH,
    "failure_threshold": 1_000_000,  # only a refused connection trips
    "failure_rate": 1.0,
    "failure_rate_min_requests": 1_000_000,
    "cooldown_max_s": 1.0,
}


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logdir = tmp_path_factory.mktemp("faults")
    engines = [engine(logdir, i) for i in range(3)]
    urls = [e.url for e in engines]
    common = {
        "policy": {"name": "round_robin"},
        "health": HEALTH,
        "timeouts": {"connect_s": 1.0, "read_s": 2.0},
        "retries": {"max_attempts": 3, "backoff_s": 0.01, "budget_min_per_s": 100.0},
    }
    main = gateway(logdir, "main", common, urls)
    pd = gateway(
        logdir,
        "pd",
        {
            **common,
            "timeouts": {"connect_s": 1.0, "read_s": 1.5},
            "pd": {"min_uncached_tokens": 16},
            "engines": [
                {"url": urls[0], "role": "prefill"},
                {"url": urls[1], "role": "decode"},
                {"url": urls[2], "role": "decode"},
            ],
        },
        [],
    )
    strict = gateway(
        logdir,
        "strict",
        {
            "policy": {"name": "round_robin"},
            "health": STRICT_HEALTH,
            "timeouts": {"connect_s": 1.0, "read_s": 5.0},
            "retries": {
                "max_attempts": 3,
                "backoff_s": 0.0,
                "budget_ratio": 0.2,
                "budget_min_per_s": 1.0,
                "budget_window_s": 10.0,
            },
            "max_in_flight": 3,
            "shutdown_grace_s": 15,
        },
        urls,
    )
    procs = [*engines, main, pd, strict]
    fleet = Fleet(engines, main, pd, strict, procs)
    try:
        for p in procs:  # all at once: the imports dominate start-up
            p.start()
        for e in engines:
            e.wait_ready("/health")
        for g in (main, pd, strict):
            g.wait_ready("/ready")
        yield fleet
    finally:
        for p in reversed(procs):
            p.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RESULTS:
        return
    terminalreporter.section("kvgate fault suite: measured")
    for fault, values in sorted(RESULTS.items()):
        shown = ", ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
        )
        terminalreporter.write_line(f"{fault}: {shown}")
    out = os.environ.get("KVGATE_FAULT_RESULTS")
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(RESULTS, fh, indent=1, sort_keys=True)
