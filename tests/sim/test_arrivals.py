"""Arrival processes: shape, rate, burstiness and spec parameters."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.errors import WorkloadError
from gateway.sim.arrivals import arrivals_from_params, gamma_arrivals, poisson_arrivals


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def _cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_rate_and_shape(rate: float) -> None:
    times = poisson_arrivals(2000, rate, random.Random(1))
    assert len(times) == 2000
    assert times[0] == 0.0
    assert times == sorted(times)
    assert statistics.fmean(_gaps(times)) == pytest.approx(1 / rate, rel=0.2)
    assert _cv(_gaps(times)) == pytest.approx(1.0, rel=0.2)


@pytest.mark.parametrize(("rate", "cv"), [(2.0, 0.5), (2.0, 1.0), (8.0, 2.0), (1.0, 3.0)])
def test_gamma_rate_and_cv(rate: float, cv: float) -> None:
    times = gamma_arrivals(20000, rate, cv, random.Random(2))
    gaps = _gaps(times)
    assert times[0] == 0.0
    assert times == sorted(times)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.2)
    assert _cv(gaps) == pytest.approx(cv, rel=0.2)


def test_gamma_cv_zero_is_evenly_spaced() -> None:
    assert gamma_arrivals(4, 2.0, 0.0, random.Random(0)) == [0.0, 0.5, 1.0, 1.5]


@pytest.mark.parametrize("n", [0, 1])
def test_tiny_n(n: int) -> None:
    assert poisson_arrivals(n, 1.0, random.Random(0)) == [0.0] * n
    assert gamma_arrivals(n, 1.0, 2.0, random.Random(0)) == [0.0] * n


def test_deterministic_given_the_rng() -> None:
    assert poisson_arrivals(50, 3.0, random.Random(7)) == poisson_arrivals(
        50, 3.0, random.Random(7)
    )
    assert poisson_arrivals(50, 3.0, random.Random(7)) != poisson_arrivals(
        50, 3.0, random.Random(8)
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: poisson_arrivals(3, 0.0, random.Random(0)), "rate"),
        (lambda: gamma_arrivals(3, -1.0, 1.0, random.Random(0)), "rate"),
        (lambda: gamma_arrivals(3, 1.0, -1.0, random.Random(0)), "cv"),
        (lambda: poisson_arrivals(-1, 1.0, random.Random(0)), "n"),
    ],
)
def test_bad_arguments(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


@given(
    n=st.integers(0, 200),
    rate=st.floats(0.01, 1000.0),
    cv=st.floats(0.0, 5.0),
    seed=st.integers(0, 2**32),
)
def test_gamma_always_sorted_from_zero(n: int, rate: float, cv: float, seed: int) -> None:
    times = gamma_arrivals(n, rate, cv, random.Random(seed))
    assert len(times) == n
    assert times == sorted(times)
    assert all(t >= 0.0 for t in times)
    if n:
        assert times[0] == 0.0


def test_params_default_is_poisson_at_default_rate() -> None:
    times = arrivals_from_params({}, 2000, 5.0, random.Random(3))
    assert times == poisson_arrivals(2000, 5.0, random.Random(3))


def test_params_gamma() -> None:
    params = {"rate": "2", "arrival": "gamma", "cv": "3"}
    times = arrivals_from_params(params, 100, 5.0, random.Random(4))
    assert times == gamma_arrivals(100, 2.0, 3.0, random.Random(4))
    default_cv = arrivals_from_params({"arrival": "gamma"}, 100, 5.0, random.Random(4))
    assert default_cv == gamma_arrivals(100, 5.0, 2.0, random.Random(4))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"arrival": "weibull"}, "unknown arrival process 'weibull'"),
        ({"rate": "0"}, "rate must be a positive"),
        ({"rate": "fast"}, "rate='fast' is not a number"),
        ({"rate": "inf"}, "rate must be a finite number"),
        ({"cv": "2"}, "cv only applies to arrival=gamma"),
        ({"arrival": "gamma", "cv": "-1"}, "cv must be a finite number >= 0"),
        ({"arrival": "gamma", "cv": "x"}, "cv='x' is not a number"),
    ],
)
def test_params_errors(params: dict[str, str], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        arrivals_from_params(params, 10, 1.0, random.Random(0))
