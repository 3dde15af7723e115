"""benchmarks.quality.samples: how samples are drawn and how their ratios are summed up."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.quality import samples


def _trace(path: Path, n: int) -> str:
    lines = [
        {"timestamp": 1000 + 250 * i, "input_length": 600, "output_length": 4, "hash_ids": [i, i]}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return f"mooncake:{path}"


def test_trace_samples_are_consecutive_windows_from_time_zero(tmp_path: Path) -> None:
    spec = _trace(tmp_path / "t.jsonl", 10)
    first, second = samples.sample(spec, 4, 0), samples.sample(spec, 4, 1)
    assert [len(first), len(second)] == [4, 4]
    assert first.requests[0].arrival == second.requests[0].arrival == 0.0
    # window 1 is requests 4-7: their own spacing, not window 0's requests again
    assert second.requests[0].block_hashes != first.requests[0].block_hashes
    assert second.requests[0].block_hashes == samples.sample(spec, 1, 4).requests[0].block_hashes
    assert math.isclose(second.requests[3].arrival, 0.75)


def test_seeded_specs_draw_one_workload_per_seed() -> None:
    spec = "gen:no_sharing?n=30&seed={seed}"
    a, b, again = (
        samples.sample(spec, 20, 0),
        samples.sample(spec, 20, 1),
        samples.sample(spec, 20, 0),
    )
    assert len(a) == 20
    assert a.requests == again.requests
    assert [r.prompt_tokens for r in a.requests] != [r.prompt_tokens for r in b.requests]


def test_ratios_take_each_samples_strongest_baseline() -> None:
    caps = {
        0: {"p": 3.0, "least_loaded": 2.0, "cache_aware": 4.0},
        1: {"p": 3.0, "least_loaded": 3.0, "cache_aware": 1.0},
    }
    assert samples.ratios(caps, "p", "best") == [0.75, 1.0]
    assert samples.ratios(caps, "p", "least_loaded") == [1.5, 1.0]
    assert math.isclose(samples.geomean([0.75, 1.0]), math.sqrt(0.75))
    att = [{"p@0.75": 0.9, "p@1": 0.8}, {"p@0.75": 1.0, "p@1": 0.9}]
    full = {k: {**v, **att[k], "shared_queue": 5.0} for k, v in caps.items()}
    assert "| p | — | 0.87 / 0.75 / 1 of 2 | 95.0% | 85.0% |" in samples.render(full, ["p"])
    alone = {k: {"p": 3.0, **att[k], "shared_queue": 5.0} for k in caps}  # no baseline run
    assert "| p | — | — | 95.0% | 85.0% |" in samples.render(alone, ["p"])


def test_samples_no_router_can_serve_are_left_out() -> None:
    """A sample whose prompts no engine can serve at the SLO has capacity 0 for every policy
    and the bound: it has no ratio (not an infinite one) and no common rate."""
    served = {"p@0.75": 0.9, "p@1": 0.8, "least_loaded@0.75": 0.9, "least_loaded@1": 0.8}
    idle = dict.fromkeys(served, math.nan)
    caps = {
        0: {"p": 3.0, "least_loaded": 2.0, **served, "shared_queue": 5.0},
        1: {"p": 0.0, "least_loaded": 0.0, **idle, "shared_queue": 0.0},
    }
    assert samples.ratios(caps, "p", "least_loaded") == [1.5]
    table = samples.render(caps, ["p", "least_loaded"])
    assert "| p | 1.50 / 1.50 / 1 of 1 | 1.50 / 1.50 / 1 of 1 | 90.0% | 80.0% |" in table
    none = {1: caps[1]}
    assert "| p | — | — | — | — |" in samples.render(none, ["p", "least_loaded"])


def test_instances_size_the_pool_each_sample_runs_on() -> None:
    """``--instances``: the shared-queue bound of one engine serves less than that of four."""
    spec = "gen:no_sharing?n=40&seed={seed}&prompt_tokens=2000"
    one = samples.run_sample(samples.Job(spec, 40, 0, "mistral-7b-a6000", (), instances=1))
    four = samples.run_sample(samples.Job(spec, 40, 0, "mistral-7b-a6000", (), instances=4))
    assert four[1]["shared_queue"] > 2 * one[1]["shared_queue"] > 0


def test_slo_targets_are_the_ones_every_request_is_judged_on() -> None:
    """``--ttft-slo``: no rate meets a TTFT target shorter than one prompt's prefill."""
    spec = "gen:no_sharing?n=40&seed={seed}&prompt_tokens=2000"
    assert samples.sample(spec, 40, 0, (0.05, 0.2)).requests[0].slo.tpot_s == 0.2
    tight = samples.run_sample(samples.Job(spec, 40, 0, "mistral-7b-a6000", (), 4, (0.05, 0.1)))
    usual = samples.run_sample(samples.Job(spec, 40, 0, "mistral-7b-a6000", (), 4))
    assert tight[1]["shared_queue"] == 0 < usual[1]["shared_queue"]


def test_scrape_interval_reaches_the_simulated_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--scrape-interval``: every run of a sample sees load as a scraping gateway would."""
    seen: list[float] = []
    real = samples.ClusterSpec

    def spy(*args: Any, **kwargs: Any) -> Any:
        cluster = real(*args, **kwargs)
        seen.append(cluster.scrape_interval_s)
        return cluster

    monkeypatch.setattr(samples, "ClusterSpec", spy)
    spec = "gen:no_sharing?n=20&seed={seed}"
    job = samples.Job(spec, 20, 0, "mistral-7b-a6000", ("least_loaded",), 2, (5.0, 0.1), 1.0)
    samples.run_sample(job)
    assert seen == [1.0]
