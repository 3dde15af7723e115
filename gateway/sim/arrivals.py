"""Arrival-time processes for synthetic workloads.

Every function takes an injected :class:`random.Random` and returns ``n``
non-decreasing arrival times in seconds, the first at ``0.0``:

* :func:`poisson_arrivals`: exponential gaps of mean ``1/rate``;
* :func:`gamma_arrivals`: Gamma gaps of mean ``1/rate`` and coefficient of
  variation ``cv`` (``cv > 1`` is burstier than Poisson, ``cv = 1`` is Poisson
  in distribution, ``cv = 0`` (or below 1e-6) gives evenly spaced arrivals).

:func:`arrivals_from_params` reads the spec parameters ``rate``, ``arrival``
(``poisson`` or ``gamma``) and ``cv`` (gamma only, default 2.0).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from gateway.core.errors import WorkloadError
from gateway.sim.workloads import float_param

ARRIVAL_PARAMS = ("rate", "arrival", "cv")
"""The spec parameters :func:`arrivals_from_params` reads."""

DEFAULT_CV = 2.0
_MIN_CV = 1e-6  # below this, gaps are constant (and 1/cv² would overflow)


def _cumulate(n: int, gap: Callable[[], float]) -> list[float]:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    out: list[float] = []
    t = 0.0
    for i in range(n):
        if i:
            t += gap()
        out.append(t)
    return out


def _check_rate(rate: float) -> None:
    if not rate > 0:
        raise ValueError(f"rate must be positive, got {rate}")


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """``n`` arrivals of a Poisson process of ``rate`` requests per second."""
    _check_rate(rate)
    return _cumulate(n, lambda: rng.expovariate(rate))


def gamma_arrivals(n: int, rate: float, cv: float, rng: random.Random) -> list[float]:
    """``n`` arrivals with Gamma gaps: mean ``1/rate``, coefficient of variation ``cv``."""
    _check_rate(rate)
    if not cv >= 0:
        raise ValueError(f"cv must be >= 0, got {cv}")
    if cv < _MIN_CV:
        return _cumulate(n, lambda: 1.0 / rate)
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    return _cumulate(n, lambda: rng.gammavariate(shape, scale))


def arrivals_from_params(
    params: Mapping[str, str], n: int, default_rate: float, rng: random.Random
) -> list[float]:
    """Arrivals as the spec asks: ``rate`` (req/s), ``arrival`` and, for gamma, ``cv``."""
    rate = float_param(params, "rate", default_rate)
    if not rate > 0 or rate == float("inf"):
        raise WorkloadError(f"parameter rate must be a positive finite number, got {rate}")
    kind = params.get("arrival", "poisson")
    if kind == "poisson":
        if "cv" in params:
            raise WorkloadError("parameter cv only applies to arrival=gamma")
        return poisson_arrivals(n, rate, rng)
    if kind == "gamma":
        cv = float_param(params, "cv", DEFAULT_CV)
        if cv == float("inf"):
            raise WorkloadError("parameter cv must be finite")
        return gamma_arrivals(n, rate, cv, rng)
    raise WorkloadError(f"unknown arrival process {kind!r} (known: poisson, gamma)")
