"""The suite command on a tiny configuration: rows, ratios, skipped traces, parallel jobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.quality import suite


def test_tiny_suite_renders_ratios_and_notes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVGATE_DATA", str(tmp_path / "no-data"))
    out = tmp_path / "suite.json"
    args = ["--presets", "mistral-7b-a6000", "--workloads", "chat,mooncake"]
    args += ["--policies", "round_robin,least_loaded", "--requests", "20", "--instances", "2"]
    args += ["--jobs", "2", "--json", str(out)]
    assert suite.main(args) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "### mistral-7b-a6000: 2 engines" in text
    assert "requests: chat 20\n" in text  # the runs' own sizes (also when merged from JSON)
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| ")]
    ll = next(r for r in rows if len(r) > 4 and r[2].strip() == "least_loaded")
    assert ll[4].strip() == "1.00"  # least_loaded / least_loaded
    matrix = next(r for r in rows if r[1].strip() == "chat")  # capacity / best baseline
    assert max(float(c) for c in matrix[2:4]) == 1.0
    assert "*shared-queue bound*" in text and "*pooled*" in text
    assert "skipped mooncake" in text  # no trace folder: a note, not a crash
    assert "[3/3]" in captured.err  # progress: 1 bounds task + 2 policies
    raw = json.loads(out.read_text())
    run = raw["runs"][0]
    assert run["workload"] == "chat" and run["requests"] == 20
    caps = {p: r["capacity"] for p, r in run["policies"].items()}
    assert set(caps) == {"round_robin", "least_loaded"}
    assert caps["least_loaded"] > 0 and run["shared_queue"]["capacity"] > 0
    assert len(run["policies"]["least_loaded"]["curve"]) == len(suite.CURVE)


def test_saturated_capacities_are_bounds_not_numbers() -> None:
    sat, fin = {"capacity": 2.0, "saturated": True}, {"capacity": 1.0}
    assert suite._r(sat, fin) == "≥ 2.00"
    assert suite._r(fin, sat) == "≤ 0.50"
    assert suite._r(sat, sat) == "sat"
    assert suite._cap(sat) == "≥ 2.00" and suite._cap(fin) == "1.00"
    assert [w.size for w in suite.WORKLOADS if w.name == "no_sharing"] == [4]


def test_unknown_names_are_refused() -> None:
    with pytest.raises(SystemExit):
        suite.main(["--workloads", "nope"])
    with pytest.raises(SystemExit):
        suite.main(["--policies", "nope"])


def test_saved_runs_merge_with_the_later_policy_results_winning() -> None:
    def run(workload: str, sq: float, **caps: float) -> dict:
        policies = {p: {"capacity": c} for p, c in caps.items()}
        return {"preset": "p", "workload": workload, "shared_queue": {"capacity": sq},
                "policies": policies}  # fmt: skip

    first = {"runs": [run("chat", 2.0, a=1.0, b=1.5), run("agent", 3.0, a=2.0)],
             "policies": ["a", "b"], "skipped": ["x"], "wall_seconds": 10.0}  # fmt: skip
    second = {"runs": [run("chat", 2.0, b=1.8, c=0.5)], "policies": ["b", "c"],
              "wall_seconds": 5.0}  # fmt: skip
    merged = suite.merge_saved([first, second])
    chat = merged["runs"][("p", "chat")]["policies"]
    assert {p: r["capacity"] for p, r in chat.items()} == {"a": 1.0, "b": 1.8, "c": 0.5}
    assert merged["runs"][("p", "agent")]["policies"] == {"a": {"capacity": 2.0}}
    assert merged["policies"] == ["a", "b", "c"] and merged["skipped"] == ["x"]
    assert merged["wall_seconds"] == 15.0
