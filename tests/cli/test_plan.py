"""``kvgate plan``: the known answer on a constructed workload, outputs, progress, bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.perfmodel.presets import load_preset
from gateway.sim.planner import smallest_passing

PROMPT = 1024  # two 512-token trace blocks, unique per request: no prefix sharing
RATE = 50.0  # req/s after --rate; the trace itself arrives at 10 req/s
TTFT_SLO = 0.5


def write_uniform_trace(path: Path, n: int = 600) -> Path:
    """Identical one-token requests, no sharing, exactly every 100 ms."""
    lines = [
        json.dumps(
            {
                "timestamp": i * 100,
                "input_length": PROMPT,
                "output_length": 1,
                "hash_ids": [2 * i, 2 * i + 1],
            }
        )
        for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def expected_pool() -> int:
    """The smallest pool for RATE under round robin, from the perf model alone.

    A request alone on an engine takes ``prefill_time(PROMPT)``; with arrivals every
    N / RATE seconds at each engine, N >= RATE * that time means no request ever
    waits (TTFT = that time, within the SLO). With one engine fewer, even full
    batches (budget // PROMPT requests per step) cannot keep up, so the backlog
    and TTFT grow without bound.
    """
    perf = load_preset("mistral-7b-a6000")
    alone = perf.prefill_time(PROMPT)
    assert alone < TTFT_SLO
    n = math.ceil(RATE * alone)
    per_step = perf.max_num_batched_tokens // PROMPT
    most = per_step / perf.step_time([(PROMPT, 0)] * per_step, 0, 0)  # req/s, one engine
    assert (n - 1) * most < 0.95 * RATE, "the constructed case must overload N-1 engines"
    assert n / RATE > alone * 1.02, "and leave N engines a margin"
    return n


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def uniform_trace(tmp_path: Path) -> Path:
    return write_uniform_trace(tmp_path / "uniform.jsonl")


def test_plan_finds_the_computed_pool_size(
    uniform_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan"
    code = main(
        [
            "plan",
            "--workload",
            f"mooncake:{uniform_trace}",
            "--rate",
            str(RATE),
            "--ttft-slo",
            str(TTFT_SLO),
            "--policies",
            "round_robin,least_loaded",
            "--max-instances",
            "16",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    want = expected_pool()
    doc = json.loads((out / "results.json").read_text())
    assert doc["rate_rps"] == pytest.approx(RATE)
    for name in ("round_robin", "least_loaded"):
        row = doc["policies"][name]
        assert row["pool"] == want, (name, row)
        assert row["attainment"] >= 0.9
        below = [p for p in row["probes"] if p["instances"] == want - 1]
        assert below and below[0]["attainment"] < 0.9  # the search saw N-1 fail
    # no sharing, identical requests: the pooled bound needs no fewer engines here
    assert doc["bound"]["pool"] == want
    assert doc["policies"]["round_robin"]["bound_fraction"] == pytest.approx(1.0)
    assert doc["recommended"] in {"round_robin", "least_loaded"}
    assert (out / "plan.png").stat().st_size > 1000
    assert f"| round_robin | {want} |" in captured.out
    assert "Recommended:" in captured.out
    # one progress line per simulation on stderr: policy, pool size, attainment, seconds
    progress = [line for line in captured.err.splitlines() if line.startswith("[plan] ")]
    sims = doc["bound"]["simulations"] + sum(r["simulations"] for r in doc["policies"].values())
    assert len(progress) == sims
    assert any(f"round_robin: {want} engines: attainment" in line for line in progress)
    assert all(line.rstrip().endswith(" s") for line in progress)


def test_plan_pd_searches_the_split(uniform_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "pd"
    code = main(
        [
            "plan",
            "--workload",
            f"mooncake:{uniform_trace}",
            "--limit",
            "200",
            "--rate",
            "20",
            "--policies",
            "least_loaded,length_heuristic",
            "--pd",
            "--max-instances",
            "8",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    doc = json.loads((out / "results.json").read_text())
    assert set(doc["policies"]) == {"least_loaded", "length_heuristic/pd"}
    pd = doc["policies"]["length_heuristic/pd"]
    assert pd["disaggregated"] and pd["pool"] is not None
    assert 1 <= pd["prefill_instances"] < pd["pool"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--attainment", "1.5"], "--attainment must be in (0, 1]"),
        (["--rate", "-3"], "--rate must be positive"),
        (["--policies", "round_robin,nope"], "unknown policy 'nope'"),
        (["--preset", "gpt-9"], "unknown preset 'gpt-9'"),
        (["--max-instances", "0"], "--max-instances must be at least 1"),
        (["--policies", "round_robin", "--pd"], "--pd needs a policy that places both legs"),
        (["--policy-option", "cache_aware.x=1"], "'cache_aware': unknown option(s) x"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    uniform_trace: Path, args: list[str], message: str
) -> None:
    proc = run_cli("--workload", f"mooncake:{uniform_trace}", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bad_workload_and_conflicting_rates_exit_2(tmp_path: Path) -> None:
    proc = run_cli("--workload", f"mooncake:{tmp_path / 'missing.jsonl'}")
    assert proc.returncode == 2 and "missing.jsonl" in proc.stderr
    proc = run_cli("--workload", "gen:tool_use?n=10", "--rate", "2", "--rate-scale", "2")
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr


def test_smallest_passing_brackets_then_bisects() -> None:
    calls: list[int] = []

    def passes(n: int) -> bool:
        calls.append(n)
        return n >= 13

    assert smallest_passing(passes, 1, hi=64) == 13
    assert len(calls) <= 2 * math.ceil(math.log2(64)) + 1
    assert smallest_passing(lambda n: n >= 13, 40, hi=64) == 13
    assert smallest_passing(lambda n: n >= 1, 8, hi=64) == 1
    assert smallest_passing(lambda n: False, 4, hi=20) is None
    assert smallest_passing(lambda n: n >= 20, 4, hi=20) == 20
    assert smallest_passing(lambda n: n >= 3, 1, lo=2, hi=8) == 3
