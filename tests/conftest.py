"""Shared test fixtures: small generated traces (never the real ones in ../shared/data)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.replicas.services import Service


def write_mooncake_trace(
    path: Path, n: int = 120, *, seed: int = 7, groups: int = 6, rate: float = 4.0
) -> Path:
    """A Mooncake-format JSONL file whose prompts share prefixes within ``groups``.

    Each group has a shared prefix of 4-10 trace blocks (512 tokens each); each
    request adds 1-3 unique blocks and a partial tail.
    """
    rng = random.Random(seed)
    next_id = 0
    prefixes = []
    for _ in range(groups):
        k = rng.randint(4, 10)
        prefixes.append(list(range(next_id, next_id + k)))
        next_id += k
    t = 0.0
    lines = []
    for _ in range(n):
        t += rng.expovariate(rate)
        shared = prefixes[min(int(rng.paretovariate(1.2)) - 1, groups - 1)]
        extra = rng.randint(1, 3)
        ids = shared + list(range(next_id, next_id + extra))
        next_id += extra
        tail = rng.randint(1, 511)
        lines.append(
            json.dumps(
                {
                    "timestamp": int(t * 1000),
                    "input_length": (len(ids) - 1) * 512 + tail,
                    "output_length": rng.randint(1, 60),
                    "hash_ids": ids,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def mooncake_trace(tmp_path: Path) -> Path:
    return write_mooncake_trace(tmp_path / "trace.jsonl")


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[Service]:
    """A real ``nats-server`` on a free port of 127.0.0.1, stopped after the test."""
    from tests.replicas.services import start_nats  # only for the tests that ask for it

    svc = start_nats(tmp_path)
    yield svc
    svc.stop()
