"""``kvgate calibrate`` measures the frontend term and the idle wake.

End to end: an emulator (time scale 1, so its metrics run on the client's clock)
whose preset has a 60 ms frontend growing 6 ms per extra stream (large next to the
emulator's own HTTP time) and a 40 ms wake after 0.5 s idle; calibration must find
them. The fits alone on made-up samples.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.calibrate.frontend import (
    FrontendSample,
    WakeSample,
    engine_clock_agrees,
    fit_frontend,
    fit_wake,
)
from gateway.cli import calibrate
from gateway.cli.demo import free_port
from gateway.perfmodel.presets import load_preset, preset_to_dict

# serial: the fit reads the emulator's wall-clock timings (an 8-token prefill measured 18 %
# slow beside another pytest-xdist worker), so it runs with the cores to itself
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvgate")
    calibrate.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["calibrate", *argv])


@pytest.mark.slow
def test_calibration_finds_the_emulated_frontend_and_wake(tmp_path: Path) -> None:
    true = load_preset("llama3-8b-h100").with_overrides(
        frontend_ms=60.0, frontend_per_stream_ms=6.0, idle_wake_ms=40.0, idle_after_s=0.5
    )
    preset = tmp_path / "true.yaml"
    preset.write_text(yaml.safe_dump(preset_to_dict(true)), encoding="utf-8")
    port = free_port()
    argv = ["emulate", "--port", str(port), "--preset", str(preset), "--log-level", "warning"]
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", *argv], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        out = tmp_path / "fitted.yaml"
        flags = ["--base-preset", "llama3-8b-h100", "--max-batched-tokens", "512"]
        args = parse("--target", url, "--out", str(out), *flags, "--repeats", "2", "--quiet")
        args.max_seconds = 60.0
        assert calibrate.run(args) == 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    fitted = load_preset(str(out))
    # the emulator's own HTTP and handler time sits on top of the modelled terms: 1-3 ms
    # on a quiet machine, up to ~12 ms (and ~3 ms per stream) at load average 10
    assert 60.0 <= fitted.frontend_ms <= 75.0
    assert 5.0 <= fitted.frontend_per_stream_ms <= 10.0  # 5.5-5.7 quiet, up to 8.7 loaded
    assert fitted.idle_wake_ms == pytest.approx(40.0, abs=12.0)
    assert 0.3 <= fitted.idle_after_s <= 0.6  # between the probed 0.3 s and 0.6 s gaps
    # prefill was fitted on the engine's own TTFT: the frontend is not in `a` twice
    assert fitted.prefill_a == pytest.approx(true.prefill_a, abs=3.0)
    assert any("engine's own time to first token" in s for s in fitted.sources)


def samples(f0: float, f1: float, scale: float = 1.0) -> list[FrontendSample]:
    """TTFT and E2E samples of an engine whose metrics are in 1/scale of client seconds."""
    out = []
    for k in (1, 2, 4, 8, 16):
        extra = f0 + f1 * (k - 1)
        for engine, e2e in ((20.0 + k, False), (100.0 * k, True)):
            out.append(FrontendSample(k, engine + extra, engine / scale, e2e))
    return out


def test_frontend_fit_recovers_intercept_and_growth() -> None:
    fit = fit_frontend(samples(5.0, 0.75), floor_ms=1.0)
    assert fit.coefficients["frontend_ms"] == pytest.approx(5.0, abs=0.3)
    assert fit.coefficients["frontend_per_stream_ms"] == pytest.approx(0.75, abs=0.1)
    assert fit.fitted == ("frontend_ms", "frontend_per_stream_ms")


def test_an_engine_on_another_clock_falls_back_to_the_http_floor() -> None:
    scaled = samples(5.0, 0.75, scale=10.0)  # a time-scale-10 emulator reports 1/10
    assert not engine_clock_agrees(scaled) and engine_clock_agrees(samples(5.0, 0.75))
    fit = fit_frontend(scaled, floor_ms=1.25)
    assert fit.coefficients == {"frontend_ms": 1.25, "frontend_per_stream_ms": 0.0}
    assert fit.fitted == ()


def test_wake_fit_finds_the_cost_and_where_it_starts() -> None:
    got = [WakeSample(g, 10.0 + (35.0 if g >= 1.0 else 0.0)) for g in (0.05, 0.3, 0.6, 1.5, 3.0)]
    fit = fit_wake(got * 2)
    assert (fit.idle_wake_ms, fit.idle_after_s) == (35.0, 1.05)
    flat = fit_wake([WakeSample(g, 10.0 + g / 10) for g in (0.05, 0.3, 0.6, 1.5, 3.0)])
    assert flat.idle_wake_ms == 0.0 and "none measured" in flat.describe()
