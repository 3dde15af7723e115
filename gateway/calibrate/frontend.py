"""Calibrating the costs outside the engine's steps: the frontend term and the idle wake.

* **Frontend.** vLLM's own ``time_to_first_token`` and ``e2e_request_latency``
  histograms time a request inside the server (from when its API process
  accepted it); the client times it end to end. Their difference, per probe, is
  what the API process and the HTTP path add: for one request at a time (the
  prefill probes) and for ``k`` concurrent streams (the decode probes), fitted
  as ``frontend_ms + frontend_per_stream_ms * (k - 1)``. The engine's clock must
  agree with the client's (a time-scaled emulator's metrics are in modelled
  seconds): when engine E2E does not grow 0.6-1.3 ms per client ms across the
  probes, the frontend falls back to the HTTP floor and the prefill times to
  client TTFT minus that floor.
* **Idle wake.** After a short request, the client waits ``gap`` seconds and
  sends a small probe; the probe's TTFT minus that after the shortest gap is its
  excess. A step fits the excesses (zero below a gap, the median excess from it
  on; the split with the least absolute error): ``idle_wake_ms`` is the step's
  height, ``idle_after_s`` the midpoint between the gaps on either side. No wake
  is fitted when it is under 1 ms or 15 % of the base TTFT.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gateway.calibrate.fit import FitError, FitResult, fit_linear

FRONTEND_TERMS = ("frontend_ms", "frontend_per_stream_ms")
WAKE_GAPS_S = (0.05, 0.3, 0.6, 1.5, 3.0)
"""Idle gaps probed (vLLM's workers busy-poll for 1 s after each message, then sleep)."""
CLOCK_SLOPE = (0.6, 1.3)


@dataclass(frozen=True, slots=True)
class LatencySums:
    """Sums and counts of an engine's TTFT and E2E histograms (seconds)."""

    ttft_sum: float
    ttft_count: float
    e2e_sum: float
    e2e_count: float

    def since(self, before: LatencySums) -> tuple[float, float] | None:
        """Mean (TTFT, E2E) in ms of the requests finished between ``before`` and this."""
        n_ttft = self.ttft_count - before.ttft_count
        n_e2e = self.e2e_count - before.e2e_count
        if n_ttft <= 0 or n_e2e <= 0:
            return None
        ttft = (self.ttft_sum - before.ttft_sum) / n_ttft
        e2e = (self.e2e_sum - before.e2e_sum) / n_e2e
        return 1000.0 * ttft, 1000.0 * e2e


@dataclass(frozen=True, slots=True)
class FrontendSample:
    """Client minus engine time (ms) of requests served ``streams`` at a time."""

    streams: int
    client_ms: float
    engine_ms: float
    e2e: bool = False

    @property
    def ms(self) -> float:
        return self.client_ms - self.engine_ms


@dataclass(frozen=True, slots=True)
class WakeSample:
    """A small probe's client TTFT (ms) after the engine sat idle ``gap_s`` seconds."""

    gap_s: float
    ms: float


def engine_clock_agrees(samples: Sequence[FrontendSample]) -> bool:
    """Do the engine's E2E times run on the client's clock? The slope of engine over client
    E2E across the probes (tens to hundreds of ms) is ~1 then, and 1/s for an emulator
    at time scale s; a constant frontend moves the intercept, not the slope."""
    pairs = [(s.client_ms, s.engine_ms) for s in samples if s.e2e]
    if len(pairs) < 3:
        return False
    x = np.array([c for c, _ in pairs])
    y = np.array([e for _, e in pairs])
    if float(np.ptp(x)) <= 0:
        return False
    slope = float(np.polyfit(x, y, 1)[0])
    lo, hi = CLOCK_SLOPE
    return lo <= slope <= hi


def fit_frontend(samples: Sequence[FrontendSample], floor_ms: float) -> FitResult:
    """``frontend_ms`` and ``frontend_per_stream_ms`` from client-minus-engine times.

    Without usable samples (or an engine clock that disagrees) the frontend is the
    HTTP floor alone, reported as nothing fitted.
    """
    usable = [s for s in samples if s.ms >= 0] if engine_clock_agrees(samples) else []
    fallback = {"frontend_ms": max(0.0, floor_ms), "frontend_per_stream_ms": 0.0}
    if not usable:
        return FitResult(fallback, (), 0, None, 0.0, 0.0)
    k = np.array([s.streams - 1 for s in usable], dtype=np.float64)
    y = np.array([s.ms for s in usable], dtype=np.float64)
    try:
        return fit_linear(np.column_stack([np.ones_like(k), k]), y, FRONTEND_TERMS, fallback)
    except FitError:  # every difference is zero: the engine adds nothing we can see
        return FitResult(fallback, (), 0, None, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class WakeFit:
    idle_wake_ms: float
    idle_after_s: float
    base_ms: float
    by_gap: tuple[tuple[float, float], ...]
    """(gap, median TTFT ms) per probed gap."""

    def describe(self) -> str:
        points = ", ".join(f"{g:g} s: {ms:.1f} ms" for g, ms in self.by_gap)
        if not self.idle_wake_ms:
            return f"idle wake: none measured (probe TTFT after idle gaps {points})"
        return (
            f"idle wake: {self.idle_wake_ms:.1f} ms after {self.idle_after_s:g} s idle "
            f"(probe TTFT after idle gaps {points})"
        )


def fit_wake(samples: Sequence[WakeSample], default_after_s: float = 1.0) -> WakeFit:
    """The wake cost and the idle time it starts at, from TTFTs after idle gaps."""
    gaps = sorted({s.gap_s for s in samples})
    med = [(g, statistics.median(s.ms for s in samples if s.gap_s == g)) for g in gaps]
    if len(med) < 2:
        return WakeFit(0.0, default_after_s, med[0][1] if med else 0.0, tuple(med))
    base = med[0][1]
    excess = [ms - base for _, ms in med]
    top = max(excess)
    if top < max(1.0, 0.15 * base):
        return WakeFit(0.0, default_after_s, base, tuple(med))
    # a step: no wake below some gap, a constant one from it on (the split that fits best)
    best: tuple[float, int, float] | None = None
    for i in range(1, len(med)):
        wake = statistics.median(excess[i:])
        cost = sum(abs(e) for e in excess[:i]) + sum(abs(e - wake) for e in excess[i:])
        if best is None or cost < best[0]:
            best = (cost, i, wake)
    assert best is not None
    _, i, wake = best
    if wake < max(1.0, 0.15 * base):
        return WakeFit(0.0, default_after_s, base, tuple(med))
    after = (med[i - 1][0] + med[i][0]) / 2
    return WakeFit(round(wake, 3), round(after, 3), base, tuple(med))
