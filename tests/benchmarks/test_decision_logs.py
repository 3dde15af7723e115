"""benchmarks.quality.reprefill and .steering: the decision logs docs/evaluation.md quotes run
against the current policy and account for every decision they count."""

from __future__ import annotations

import re
import sys

import pytest

from benchmarks.quality import reprefill, steering, ttft_error

WORKLOAD = "gen:long_doc_qa?docs=20&n=80&rate=8&seed=1"


def _run(main: object, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    old = sys.argv
    sys.argv = ["prog", *argv]
    try:
        main()  # type: ignore[operator]
    finally:
        sys.argv = old
    return capsys.readouterr().out


def test_reprefill_counts_each_request_that_left_its_holder_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = _run(reprefill.main, [WORKLOAD, "12", "--requests", "80"], capsys)
    m = re.search(r"(\d+) of (\d+) requests left the engine holding their prompt", out)
    assert m, out
    moved, decisions = int(m[1]), int(m[2])
    assert decisions == 80 and moved > 0, out
    reasons = re.findall(r"(aging bound|TTFT filter|TPOT filter|TTFT margin|tie|cost) (\d+)", out)
    assert sum(int(n) for _, n in reasons) == moved, out


def test_reprefill_takes_the_policys_options(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(
        reprefill.main,
        [WORKLOAD, "12", "--requests", "80", "--options", "decode_in_cost=false"],
        capsys,
    )
    assert "decode_in_cost=false" in out
    with pytest.raises(Exception, match="unknown option"):
        _run(reprefill.main, [WORKLOAD, "12", "--requests", "80", "--options", "nope=1"], capsys)


def test_steering_reports_the_decisions_it_counted(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(steering.main, [WORKLOAD, "1", "--requests", "80", "--margin", "0"], capsys)
    m = re.search(r"(\d+) of (\d+) decisions went to an engine", out)
    assert m and int(m[2]) == 80, out


def test_ttft_error_puts_every_served_request_in_one_kv_band(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = _run(ttft_error.main, ["gen:agent?n=80&seed=1", "9", "--requests", "80"], capsys)
    bands = [int(n) for n in re.findall(r"at the decision:\s+(\d+) requests", out)]
    m = re.search(r"(\d+) of (\d+) served requests missed the TTFT target", out)
    assert bands and m, out
    assert sum(bands) == int(m[2]) and 0 < int(m[2]) <= 80, out
