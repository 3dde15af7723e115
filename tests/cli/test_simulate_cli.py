"""``kvgate simulate`` as a user runs it: outputs, determinism and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_simulate_writes_results_report_and_plots(mooncake_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(
        [
            "simulate",
            "--workload",
            f"mooncake:{mooncake_trace}",
            "--policies",
            "round_robin,cache_aware",
            "--instances",
            "4",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["policies"]) == {"round_robin", "cache_aware"}
    assert results["instances"] == 4
    report = (out / "report.md").read_text()
    assert "| round_robin |" in report and "| cache_aware |" in report
    assert (out / "ttft_cdf.png").stat().st_size > 1000
    assert (out / "load_cv.png").stat().st_size > 1000


def test_same_seed_gives_identical_files(mooncake_trace: Path, tmp_path: Path) -> None:
    texts = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert (
            main(
                [
                    "simulate",
                    "--workload",
                    f"mooncake:{mooncake_trace}",
                    "--instances",
                    "3",
                    "--seed",
                    "9",
                    "--no-timing",
                    "--no-plots",
                    "--quiet",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        texts.append((out / "results.json").read_text())
    assert texts[0] == texts[1]


def test_progress_line_per_policy(mooncake_trace: Path, tmp_path: Path) -> None:
    proc = run_cli(
        "simulate",
        "--workload",
        f"mooncake:{mooncake_trace}",
        "--policies",
        "round_robin,least_loaded",
        "--no-plots",
        "--out",
        str(tmp_path / "o"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "[1/2] round_robin" in proc.stderr and "[2/2] least_loaded" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "round_robin,nope"], "unknown policy 'nope'"),
        (["--preset", "gpt-9"], "unknown preset 'gpt-9'"),
        (["--instances", "0"], "--instances must be positive"),
        (
            ["--policies", "cache_aware", "--policy-option", "round_robin.x=1"],
            "names a policy not in --policies",
        ),
        (["--policy-option", "cache_aware.x=1"], "'cache_aware': unknown option(s) x"),
    ],
)
def test_bad_flags_give_one_line_errors(
    mooncake_trace: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    proc = run_cli(
        "simulate", "--workload", f"mooncake:{mooncake_trace}", "--out", str(tmp_path / "o"), *args
    )
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 2}', "missing field 'hash_ids'"),
        (
            '{"timestamp": 1, "input_length": 0, "output_length": 2, "hash_ids": []}',
            "input_length must be an integer >= 1",
        ),
        (
            '{"timestamp": -1, "input_length": 5, "output_length": 2, "hash_ids": [1]}',
            "timestamp must be a number >= 0",
        ),
        (
            '{"timestamp": 1, "input_length": 5, "output_length": 2, "hash_ids": ["x"]}',
            "hash_ids must be a list of integers",
        ),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_trace_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    trace = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}'
    trace.write_text(f"{good}\n{good}\n{line}\n")
    proc = run_cli("simulate", "--workload", f"mooncake:{trace}", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert f"{trace}:3: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mooncake:/no/such/file.jsonl", "/no/such/file.jsonl: trace file not found"),
        ("gen:nonsense", "unknown generator 'nonsense'"),
        ("parquet:x", "unknown workload kind 'parquet'"),
        ("justapath", "must look like"),
        ("gen:tool_use?n=abc", "n='abc' is not an integer"),
        ("gen:tool_use?slo_mix=gold:1", "unknown SLO class 'gold'"),
    ],
)
def test_bad_workload_specs(tmp_path: Path, spec: str, message: str) -> None:
    proc = run_cli("simulate", "--workload", spec, "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_mixed_slo_classes_are_reported_per_class(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert (
        main(
            [
                "simulate",
                "--workload",
                "gen:tool_use?n=80&rate=4&slo_mix=interactive:1,batch:1",
                "--policies",
                "round_robin",
                "--instances",
                "2",
                "--no-plots",
                "--quiet",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    pol = json.loads((out / "results.json").read_text())["policies"]["round_robin"]
    assert set(pol["per_class"]) == {"interactive", "batch"}
    assert sum(c["requests"] for c in pol["per_class"].values()) == 80
    assert "## Per SLO class" in (out / "report.md").read_text()
