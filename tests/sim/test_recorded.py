"""The ``recorded:`` workload: kvgate's recordings (Mooncake lines plus extra fields)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.core.errors import WorkloadError
from gateway.sim.mooncake import recorded_files
from gateway.sim.workloads import WorkloadOptions, load_workload

OPTS = WorkloadOptions(block_size=16)


def row(ts: int, ids: list[int], **kw: Any) -> dict[str, Any]:
    base = {
        "timestamp": ts,
        "input_length": 16 * len(ids) + 5,
        "output_length": 7,
        "hash_ids": ids,
        "block_size": 16,
        "model": "m",
        "slo_class": "standard",
        "ok": True,
        "recording_start": 1_000_000,
    }
    return {**base, **kw}


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_rotated_files_merge_in_time_order(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    write(path.with_name("rec.jsonl.2"), [row(100, [1, 2]), row(300, [1, 3])])
    write(path.with_name("rec.jsonl.1"), [row(200, [1, 2, 4]), row(500, [9])])
    write(path, [row(400, [1]), row(450, [8, 7])])
    write(tmp_path / "rec.jsonl.bak", [row(1, [5])])  # not a rotation
    assert [p.name for p in recorded_files(str(path))] == [
        "rec.jsonl.2",
        "rec.jsonl.1",
        "rec.jsonl",
    ]
    wl = load_workload(f"recorded:{path}", OPTS)
    assert [r.arrival for r in wl.requests] == [0.0, 0.1, 0.2, 0.3, 0.35, 0.4]
    assert [r.block_hashes for r in wl.requests[:3]] == [(1, 2), (1, 2, 4), (1, 3)]
    assert [r.id for r in wl.requests] == [f"req-{i}" for i in range(6)]


def test_directories_and_globs(tmp_path: Path) -> None:
    write(tmp_path / "a.jsonl", [row(0, [1])])
    write(tmp_path / "b.jsonl", [row(10, [2])])
    (tmp_path / ".hidden").write_text("not json\n")
    assert len(load_workload(f"recorded:{tmp_path}", OPTS)) == 2
    assert len(load_workload(f"recorded:{tmp_path}/b*", OPTS)) == 1
    with pytest.raises(WorkloadError, match="no recording files match"):
        load_workload(f"recorded:{tmp_path}/zz*", OPTS)
    with pytest.raises(WorkloadError, match="not found"):
        load_workload(f"recorded:{tmp_path}/nope.jsonl", OPTS)


def test_recordings_of_several_processes_share_one_timeline(tmp_path: Path) -> None:
    write(tmp_path / "gw1.jsonl", [row(0, [1]), row(2000, [2])])
    write(tmp_path / "gw2.jsonl", [row(500, [3], recording_start=1_001_000)])
    wl = load_workload(f"recorded:{tmp_path}", OPTS)
    assert [(r.arrival, r.block_hashes) for r in wl.requests] == [
        (0.0, (1,)),
        (1.5, (3,)),
        (2.0, (2,)),
    ]


def test_block_sizes_are_re_cut_keeping_shared_prefixes(tmp_path: Path) -> None:
    path = write(
        tmp_path / "r.jsonl",
        [row(0, [1, 2, 3, 4]), row(1, [1, 2, 5, 6]), row(2, [7, 8, 9, 10])],
    )
    for block in (8, 16, 32):
        reqs = load_workload(f"recorded:{path}", WorkloadOptions(block_size=block)).requests
        a, b, c = (r.block_hashes for r in reqs)
        assert len(a) == (16 * 4 + 5) // block if block < 16 else 64 // block
        shared = 32 // block
        assert a[:shared] == b[:shared] and a[shared] != b[shared]
        assert not set(a) & set(c)  # a different first id: nothing shared
    coarse = write(tmp_path / "c.jsonl", [row(0, [1, 2], block_size=512, input_length=1024)])
    assert len(load_workload(f"recorded:{coarse}", OPTS).requests[0].block_hashes) == 64


def test_slo_classes_models_and_failures(tmp_path: Path) -> None:
    path = write(
        tmp_path / "r.jsonl",
        [
            row(0, [1], slo_class="interactive"),
            row(1, [2], slo_class="premium"),  # unknown here: the default class
            row(2, [3], model="other", slo_class="batch"),
            row(3, [4], ok=False),
        ],
    )
    wl = load_workload(f"recorded:{path}", OPTS)
    assert [r.slo.name for r in wl.requests] == ["interactive", "standard", "batch", "standard"]
    assert len(load_workload(f"recorded:{path}?model=m", OPTS)) == 3
    assert len(load_workload(f"recorded:{path}?failed=drop", OPTS)) == 3
    assert len(load_workload(f"recorded:{path}?model=m&failed=drop", OPTS)) == 2
    with pytest.raises(WorkloadError, match="of model 'zz'"):
        load_workload(f"recorded:{path}?model=zz", OPTS)
    with pytest.raises(WorkloadError, match="failed must be keep or drop"):
        load_workload(f"recorded:{path}?failed=maybe", OPTS)
    with pytest.raises(WorkloadError, match="unknown parameter"):
        load_workload(f"recorded:{path}?trace_block=16", OPTS)


def test_rate_scale_and_limit_apply(tmp_path: Path) -> None:
    path = write(tmp_path / "r.jsonl", [row(1000 * i, [i]) for i in range(10)])
    wl = load_workload(f"recorded:{path}", WorkloadOptions(block_size=16, rate_scale=4.0))
    assert wl.requests[-1].arrival == pytest.approx(9 / 4)
    wl = load_workload(f"recorded:{path}", WorkloadOptions(block_size=16, limit=3))
    assert len(wl) == 3


def test_plain_mooncake_traces_load_too(mooncake_trace: Path) -> None:
    rec = load_workload(f"recorded:{mooncake_trace}", OPTS)
    moon = load_workload(f"mooncake:{mooncake_trace}", OPTS)
    assert [r.block_hashes for r in rec.requests] == [r.block_hashes for r in moon.requests]
    first = moon.requests[0].arrival
    assert [r.arrival for r in rec.requests] == pytest.approx(
        [r.arrival - first for r in moon.requests]
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"block_size": 0}, "block_size must be an integer >= 1"),
        ({"block_size": "16"}, "block_size must be an integer"),
        ({"recording_start": "x"}, "recording_start must be a number"),
        ({"output_length": 0}, "output_length must be an integer >= 1"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, extra: dict[str, Any], message: str) -> None:
    path = write(tmp_path / "r.jsonl", [row(0, [1]), row(1, [2], **extra)])
    with pytest.raises(WorkloadError, match=message) as info:
        load_workload(f"recorded:{path}", OPTS)
    assert "r.jsonl" in str(info.value) and "2" in str(info.value)
