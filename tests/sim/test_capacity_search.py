"""search_rate, directly: synthetic attainment curves with known thresholds.

The search must land within 2 % below the threshold (never above it: the answer
is a rate that was seen to pass), take few evaluations, and behave sanely when
the curve never passes, always passes or is not monotone.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gateway.sim.runner import CAPACITY_TOLERANCE, search_rate


def counted(f: Callable[[float], float]) -> tuple[Callable[[float], float], list[float]]:
    seen: list[float] = []

    def g(factor: float) -> float:
        seen.append(factor)
        return f(factor)

    return g, seen


@pytest.mark.parametrize("threshold", [0.03, 0.37, 0.99, 1.0, 1.01, 1.9, 3.7, 17.0, 63.0])
@pytest.mark.parametrize("base", [1.0, 2.5])
def test_finds_a_step_threshold_within_two_percent(threshold: float, base: float) -> None:
    f, seen = counted(lambda x: 1.0 if x <= threshold else 0.5)
    rate, runs = search_rate(base, f, 0.9)
    assert base * threshold / (1 + CAPACITY_TOLERANCE) <= rate <= base * threshold
    assert f(rate / base) >= 0.9  # a measured passing rate
    assert runs == len(seen) - 1 <= 14


def test_smooth_monotone_curve() -> None:
    # attainment 1 / (1 + (x / 4) ** 8) crosses 0.9 at x = 4 * (1/9) ** (1/8)
    crossing = 4 * (1 / 9) ** (1 / 8)
    rate, _ = search_rate(10.0, lambda x: 1 / (1 + (x / 4) ** 8), 0.9)
    assert 10 * crossing / 1.02 <= rate <= 10 * crossing


def test_tolerance_and_step_cap() -> None:
    fine, fine_runs = search_rate(1.0, lambda x: float(x <= 3.7), 0.9, tolerance=0.001)
    assert 3.7 / 1.001 <= fine <= 3.7
    coarse, coarse_runs = search_rate(1.0, lambda x: float(x <= 3.7), 0.9, max_steps=1)
    assert coarse == 3.0 and coarse_runs < fine_runs  # bracket [2, 4], one bisection
    with pytest.raises(ValueError):
        search_rate(1.0, lambda x: 1.0, 0.9, tolerance=0)


def test_edge_cases() -> None:
    never, runs = search_rate(3.0, lambda x: 0.0, 0.9)
    assert never == 0.0 and runs == 7  # 1x, then halvings down to the 1/64 floor
    always, runs = search_rate(3.0, lambda x: 1.0, 0.9)
    assert always == 3.0 * 64 and runs == 7  # capped at 64x
    assert search_rate(0.0, lambda x: 1.0, 0.9) == (0.0, 0)
    free, runs = search_rate(1.0, lambda x: float(x <= 1.5), 0.9, free_first=True)
    assert 1.5 / 1.02 <= free <= 1.5
    _, counted_runs = search_rate(1.0, lambda x: float(x <= 1.5), 0.9)
    assert counted_runs == runs + 1  # the 1x run was not counted


def test_non_monotone_curve_returns_a_passing_rate_next_to_a_failing_one() -> None:
    # passes up to 0.3 and again on [0.45, 0.8]; fails at 1x
    def f(x: float) -> float:
        return 1.0 if x <= 0.3 or 0.45 <= x <= 0.8 else 0.0

    g, seen = counted(f)
    rate, _ = search_rate(1.0, g, 0.9)
    assert f(rate) == 1.0
    failing_above = [x for x in seen if x > rate and f(x) == 0.0]
    assert failing_above and min(failing_above) <= rate * 1.02
    assert rate == pytest.approx(0.8, rel=0.02)  # the bracket [0.5, 1] holds the upper window
