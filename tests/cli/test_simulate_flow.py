"""``kvgate simulate --flow-control``: the same flow control as ``kvgate serve``, compared
with it off on one workload with tenant and priority mixes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gateway.cli import main

SPEC = (
    "gen:no_sharing?n=240&rate=24&prompt_tokens=1000&output_tokens=16"
    "&slo_mix=interactive:0.2,batch:0.8&priority_by_slo=interactive:0,batch:10"
    "&tenant_mix=a:1,b:1,flood:10"
)


def simulate(out: Path, *flow: str) -> dict[str, object]:
    args = ["simulate", "--workload", SPEC, "--preset", "mistral-7b-a6000", "--instances", "2"]
    args += ["--policies", "least_loaded", "--out", str(out), "--quiet", "--no-plots", *flow]
    assert main(args) == 0
    result: dict[str, object] = json.loads((out / "results.json").read_text())
    return result["policies"]["least_loaded"]  # type: ignore[index,no-any-return]


def test_flow_control_settings_compare_in_the_simulator(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text("flow_control:\n  max_ttft_s: 0.1\n  queue_timeout_s: 60\n")
    off = simulate(tmp_path / "off")
    on = simulate(tmp_path / "on", "--flow-control", str(config))
    p99 = {
        name: run["per_class"]["interactive"]["ttft_p99"]
        for name, run in (("off", off), ("on", on))
    }  # type: ignore[index]
    assert p99["on"] < 0.5 * p99["off"]
    assert "flow" not in off and on["flow"]["queued"] > 0  # type: ignore[index]
    assert on["rejected"] == 0


def test_a_bad_flow_control_section_is_a_one_line_error(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text("flow_control:\n  max_ttft_s: -1\n")
    cmd = [sys.executable, "-m", "gateway.cli", "simulate", "--workload", SPEC]
    cmd += ["--flow-control", str(config), "--out", str(tmp_path / "o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--flow-control" in proc.stderr and "max_ttft_s" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
