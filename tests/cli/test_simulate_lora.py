"""``kvgate simulate`` and ``kvgate plan`` on LoRA traffic: adapter flags and their errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.cli.simulate import apply_lora_args
from gateway.core.errors import ConfigError
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset

WORKLOAD = "gen:lora?n=120&adapters=6&rate=6"


def simulate(out: Path, *flags: str) -> dict[str, dict[str, float]]:
    args = ["simulate", "--workload", WORKLOAD, "--policies", "least_loaded", "--instances"]
    code = main([*args, "3", "--no-plots", "--no-timing", "--quiet", "--out", str(out), *flags])
    assert code == 0
    policies: dict[str, dict[str, float]] = json.loads((out / "results.json").read_text())[
        "policies"
    ]
    return policies


def test_lora_flags_reach_the_engines(tmp_path: Path) -> None:
    one = simulate(tmp_path / "one", "--max-loras", "1")["least_loaded"]
    four = simulate(tmp_path / "four", "--max-loras", "4", "--max-cpu-loras", "6")["least_loaded"]
    assert four["ttft_mean"] < 0.5 * one["ttft_mean"]  # one slot: adapters wait for it
    assert four["lora_loads"] <= one["lora_loads"]
    slow = simulate(tmp_path / "slow", "--max-loras", "1", "--lora-load-s", "2")["least_loaded"]
    assert slow["lora_loads"] > 0 and slow["ttft_p50"] > one["ttft_p50"]
    assert "LoRA loads" in (tmp_path / "one" / "report.md").read_text()


def test_hide_adapters_blinds_the_views(tmp_path: Path) -> None:
    seen = simulate(tmp_path / "seen", "--max-loras", "2")["least_loaded"]
    blind = simulate(tmp_path / "blind", "--max-loras", "2", "--hide-adapters")["least_loaded"]
    assert seen["lora_loads"] < blind["lora_loads"]


def test_plan_runs_on_lora_traffic(tmp_path: Path) -> None:
    args = ["plan", "--workload", WORKLOAD, "--policies", "least_loaded", "--max-loras", "2"]
    assert main([*args, "--max-instances", "4", "--quiet", "--out", str(tmp_path / "p")]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args[:-1], "0", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--max-loras must be positive" in proc.stderr
    assert "Traceback" not in proc.stderr


def _ns(**values: object) -> argparse.Namespace:
    base: dict[str, object] = {"max_loras": None, "max_cpu_loras": None, "lora_load_s": None}
    base.update(values)
    return argparse.Namespace(**base)


def test_bad_lora_flags_are_clear_errors() -> None:
    perf = load_preset(DEFAULT_PRESET)
    assert apply_lora_args(perf, _ns()) is perf
    with pytest.raises(ConfigError, match="--max-loras must be positive"):
        apply_lora_args(perf, _ns(max_loras=0))
    with pytest.raises(ConfigError, match="--max-cpu-loras must be 0 or >= max-loras"):
        apply_lora_args(perf, _ns(max_loras=4, max_cpu_loras=2))
    with pytest.raises(ConfigError, match="--lora-load-s must be finite"):
        apply_lora_args(perf, _ns(lora_load_s=-1.0))
