"""The Azure 2023 CSV loader, on tiny generated fixtures."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.core.errors import WorkloadError
from gateway.sim.azure import load_azure, parse_timestamp
from gateway.sim.workloads import WorkloadOptions, load_workload

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
OPTIONS = WorkloadOptions()


def write_csv(tmp_path: Path, rows: list[str], header: str = HEADER, name: str = "t.csv") -> str:
    path = tmp_path / name
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return str(path)


def synthetic_rows(count: int, seed: int = 0) -> list[str]:
    """``count`` rows a tenth of a second apart with contexts of 500..1500 tokens."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        sec, tenth = divmod(i, 10)
        ctx, out = rng.randint(500, 1500), rng.randint(1, 300)
        rows.append(f"2023-11-16 18:{sec // 60:02d}:{sec % 60:02d}.{tenth}000000,{ctx},{out}")
    return rows


def test_parses_rows(tmp_path: Path) -> None:
    path = write_csv(
        tmp_path,
        [
            "2023-11-16 18:15:46.6805900,374,44",
            "2023-11-16 18:15:50.9951690,396,109",
            "2023-11-16 18:15:51.2224670,879,55",
        ],
    )
    reqs = load_azure(path, OPTIONS, None)
    assert [r.id for r in reqs] == ["azure-0", "azure-1", "azure-2"]
    assert [r.arrival for r in reqs] == pytest.approx([0.0, 4.314579, 4.541877], abs=1e-9)
    assert [r.prompt_tokens for r in reqs] == [374, 396, 879]
    assert [r.output_tokens for r in reqs] == [44, 109, 55]
    assert [len(r.block_hashes) for r in reqs] == [374 // 16, 396 // 16, 879 // 16]
    assert all(r.slo == OPTIONS.default_class and r.session is None for r in reqs)
    hashes = [h for r in reqs for h in r.block_hashes]
    assert len(hashes) == len(set(hashes))  # no sharing by default


@pytest.mark.parametrize(
    ("first", "second", "seconds"),
    [
        ("2023-11-16 18:15:46.6805900", "2023-11-16 18:15:46.6805901", 1e-7),
        ("2023-11-16 23:59:59.9999999", "2023-11-17 00:00:00.0000001", 2e-7),
        ("2023-11-16 18:15:46", "2023-11-16 18:15:47.5", 1.5),
        ("2023-12-31 23:00:00.0", "2024-01-01T01:00:00.000000000", 7200.0),
        ("2023-11-16 18:15:46.123456789123", "2023-11-16 18:15:46.123456790", 1e-9),
    ],
)
def test_parse_timestamp(first: str, second: str, seconds: float) -> None:
    delta = parse_timestamp(second) - parse_timestamp(first)
    assert delta / 1e9 == pytest.approx(seconds, abs=1e-12)


@pytest.mark.parametrize(
    "text", ["", "yesterday", "2023-11-16", "2023-13-01 00:00:00", "2023-11-16 25:00:00", "1.5"]
)
def test_parse_timestamp_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="timestamp"):
        parse_timestamp(text)


def test_arrival_from_earliest_row_and_zero_output(tmp_path: Path) -> None:
    path = write_csv(
        tmp_path, ["2023-11-16 18:00:01.0000000,100,0", "2023-11-16 18:00:00.0000000,100,5"]
    )
    reqs = load_azure(path, OPTIONS, {})
    assert [r.arrival for r in reqs] == [1.0, 0.0]
    assert [r.output_tokens for r in reqs] == [1, 5]


def test_limit_stops_reading_early(tmp_path: Path) -> None:
    rows = ["2023-11-16 18:00:00.0,100,5", "2023-11-16 18:00:01.0,200,5", "garbage"]
    path = write_csv(tmp_path, rows)
    reqs = load_azure(path, replace(OPTIONS, limit=2), None)
    assert [r.prompt_tokens for r in reqs] == [100, 200]


def test_bom_blank_lines_and_quotes(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        f'\ufeff{HEADER}\r\n"2023-11-16 18:00:00.5",32,2\r\n\r\n2023-11-16 18:00:02.5,48,3\r\n',
        encoding="utf-8",
    )
    reqs = load_azure(str(path), OPTIONS, None)
    assert [(r.arrival, r.prompt_tokens, len(r.block_hashes)) for r in reqs] == [
        (0.0, 32, 2),
        (2.0, 48, 3),
    ]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("2023-11-16 18:00:01.0,100", "expected 3 fields"),
        ("2023-11-16 18:00:01.0,100,5,7", "expected 3 fields"),
        ("16/11/2023 18:00:01,100,5", "bad timestamp"),
        ("2023-11-16 18:00:01.0,many,5", "ContextTokens must be an integer >= 1, got 'many'"),
        ("2023-11-16 18:00:01.0,0,5", "ContextTokens must be an integer >= 1"),
        ("2023-11-16 18:00:01.0,100,-2", "GeneratedTokens must be an integer >= 0"),
        ("2023-11-16 18:00:01.0,100,4.5", "GeneratedTokens must be an integer"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path: Path, row: str, message: str) -> None:
    path = write_csv(tmp_path, ["2023-11-16 18:00:00.0,100,5", "", row])
    with pytest.raises(WorkloadError) as info:
        load_azure(path, OPTIONS, None)
    text = str(info.value)
    assert text.startswith(f"{path}:4: ")
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize(
    ("content", "message", "line"),
    [
        ("", "empty file", 1),
        (f"{HEADER}\n", "trace has no requests", None),
        ("time,in,out\n2023-11-16 18:00:00.0,100,5\n", "bad header 'time,in,out'", 1),
        ("TIMESTAMP,ContextTokens\n", "bad header", 1),
    ],
)
def test_bad_files(tmp_path: Path, content: str, message: str, line: int | None) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(WorkloadError, match=message) as info:
        load_azure(str(path), OPTIONS, None)
    assert info.value.path == str(path)
    assert info.value.line == line


def test_missing_file_and_not_utf8(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="trace file not found"):
        load_azure(str(tmp_path / "nope.csv"), OPTIONS, None)
    binary = tmp_path / "bin.csv"
    binary.write_bytes(HEADER.encode() + b"\n\xff\xfe,1,1\n")
    with pytest.raises(WorkloadError, match="not UTF-8"):
        load_azure(str(binary), OPTIONS, None)


def test_share_synthesises_prefixes(tmp_path: Path) -> None:
    path = write_csv(tmp_path, synthetic_rows(400))
    reqs = load_azure(path, OPTIONS, {"share": "1", "prefixes": "5"})
    firsts = Counter(r.block_hashes[0] for r in reqs)
    assert len(firsts) <= 5
    assert firsts.most_common(1)[0][1] > 400 / 5  # Zipf skew
    # A prefix keeps one length: same first hash -> same longest common run.
    groups: dict[int, list[tuple[int, ...]]] = {}
    for r in reqs:
        groups.setdefault(r.block_hashes[0], []).append(r.block_hashes)
    for members in groups.values():
        common = {
            next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            for a, b in itertools.pairwise(members)
        }
        common.discard(None)
        assert len(common) <= 1
    assert [r.prompt_tokens for r in reqs] == [r.prompt_tokens for r in load_azure(path, OPTIONS)]


def test_partial_share(tmp_path: Path) -> None:
    path = write_csv(tmp_path, synthetic_rows(400))
    reqs = load_azure(path, OPTIONS, {"share": "0.5", "prefixes": "3", "zipf": "0"})
    firsts = Counter(r.block_hashes[0] for r in reqs)
    shared = sum(c for c in firsts.values() if c > 1)
    assert len([c for c in firsts.values() if c > 1]) == 3
    assert 0.4 * 400 < shared < 0.6 * 400


def test_share_is_deterministic(tmp_path: Path) -> None:
    path = write_csv(tmp_path, synthetic_rows(100))
    params = {"share": "0.7"}
    assert load_azure(path, OPTIONS, params) == load_azure(path, OPTIONS, params)
    other = load_azure(path, OPTIONS, {**params, "seed": "9"})
    assert other != load_azure(path, OPTIONS, params)
    assert other == load_azure(path, replace(OPTIONS, seed=9), params)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"share": "2"}, "share must be <= 1"),
        ({"share": "-0.1"}, "share must be a finite number >= 0"),
        ({"share": "lots"}, "share='lots' is not a number"),
        ({"prefixes": "0"}, "prefixes must be >= 1"),
        ({"prefix_frac": "1.5"}, "prefix_frac must be <= 1"),
        ({"rate": "3"}, "azure: unknown parameter.*rate"),
    ],
)
def test_bad_params(tmp_path: Path, params: dict[str, str], message: str) -> None:
    path = write_csv(tmp_path, synthetic_rows(3))
    with pytest.raises(WorkloadError, match=message):
        load_azure(path, OPTIONS, params)


def test_via_load_workload(tmp_path: Path) -> None:
    path = write_csv(tmp_path, synthetic_rows(30))
    workload = load_workload(f"azure:{path}?share=0.5", replace(OPTIONS, limit=20))
    assert len(workload) == 20
    assert workload.span == pytest.approx(1.9)
