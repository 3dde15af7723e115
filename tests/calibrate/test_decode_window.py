"""The decode-step estimate over a streaming window, including bursty delivery."""

from __future__ import annotations

import pytest

from gateway.calibrate.client import StreamResult
from gateway.calibrate.probes import decode_step_seconds


def stream(times: list[float], tokens: list[int]) -> StreamResult:
    return StreamResult(sent=0.0, times=times, tokens=tokens)


def test_even_stream_gives_the_gap() -> None:
    r = stream([0.1 + 0.02 * i for i in range(20)], list(range(1, 21)))
    assert decode_step_seconds([r], 0.1, 0.48) == pytest.approx(0.02)


def test_bursts_are_counted_at_the_production_rate() -> None:
    # 20 ms per token, but the server flushes five tokens at a time
    times, tokens = [], []
    for burst in range(5):
        for j in range(5):
            times.append(0.1 * (burst + 1) + 1e-5 * j)
            tokens.append(5 * burst + j + 1)
    step = decode_step_seconds([stream(times, tokens)], 0.0, 1.0)
    assert step is not None
    assert 0.015 < step < 0.025  # the median chunk gap here would be 10 µs


def test_median_over_streams_and_window_bounds() -> None:
    fast = stream([0.0, 0.01, 0.02, 0.03], [1, 2, 3, 4])
    slow = stream([0.0, 0.03, 0.06, 0.09], [1, 2, 3, 4])
    mid = stream([0.0, 0.02, 0.04, 0.06], [1, 2, 3, 4])
    assert decode_step_seconds([fast, slow, mid], 0.0, 0.1) == pytest.approx(0.02)
    # chunks outside the window are ignored: only one chunk left -> no estimate
    assert decode_step_seconds([fast], 0.025, 0.1) is None
    assert decode_step_seconds([], 0.0, 1.0) is None
