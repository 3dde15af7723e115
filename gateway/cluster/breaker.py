"""Per-engine circuit breaker with half-open probing, and the sliding window it counts on.

States and transitions (one :class:`CircuitBreaker` per engine, driven by the
registry with request outcomes and health-probe results):

* **closed** — traffic flows. It opens after ``failure_threshold`` failures in
  a row, or when at least ``min_requests`` outcomes in the last ``window_s``
  seconds include a share of failures of ``failure_rate`` or more, or at once
  on an ``immediate`` failure (a refused connection: the process is gone).
* **open** — no traffic for a cooldown: ``cooldown_s × 2^(trips-1)``, capped
  at ``cooldown_max_s``, times a random factor in ``1 ± jitter`` (so engines
  that failed together do not come back in lockstep). ``trips`` counts the
  openings since the breaker last stayed closed for ``cooldown_max_s``.
* **half-open** — when the cooldown is over; the test is of the kind of the
  failure that opened it. Opened by failed requests (5xx, resets, timeouts,
  broken streams): at most ``half_open_requests`` trial requests are admitted
  at once, and ``recovery_threshold`` successful ones close it (a passing
  ``/health`` says nothing about requests that failed). Opened by failed health
  probes or a refused connection (the process is down or hung): no request is
  risked, and ``recovery_threshold`` good probes close it. Any failure opens it
  again with the next, longer cooldown.

Nothing here does I/O or reads a clock: every call takes ``now``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from enum import StrEnum

from gateway.config import HealthConfig


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


STATE_VALUE = {BreakerState.CLOSED: 0.0, BreakerState.HALF_OPEN: 1.0, BreakerState.OPEN: 2.0}
"""The ``kvgate_engine_breaker_state`` gauge's encoding."""

Transition = tuple[BreakerState, BreakerState]


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 2
    recovery_threshold: int = 1
    cooldown_s: float = 5.0
    cooldown_max_s: float = 60.0
    jitter: float = 0.2
    failure_rate: float = 0.5
    window_s: float = 10.0
    min_requests: int = 20
    half_open_requests: int = 1


class SlidingWindow:
    """Counts of two kinds of events over the last ``window_s`` seconds, in ``buckets``
    equal time buckets (the window slides one bucket at a time)."""

    def __init__(self, window_s: float, buckets: int = 10) -> None:
        if not window_s > 0 or buckets < 1:
            raise ValueError("the window must be positive and have at least one bucket")
        self.width = window_s / buckets
        self.size = buckets
        self._a = [0] * buckets
        self._b = [0] * buckets
        self._epoch: int | None = None

    def _advance(self, now: float) -> int:
        epoch = math.floor(now / self.width)
        last = self._epoch
        if last is None or epoch - last >= self.size:
            self._a = [0] * self.size
            self._b = [0] * self.size
        elif epoch > last:
            for e in range(last + 1, epoch + 1):
                i = e % self.size
                self._a[i] = 0
                self._b[i] = 0
        if last is None or epoch > last:
            self._epoch = epoch
        return (self._epoch or 0) % self.size

    def add(self, now: float, a: int = 0, b: int = 0) -> None:
        i = self._advance(now)
        self._a[i] += a
        self._b[i] += b

    def totals(self, now: float) -> tuple[int, int]:
        self._advance(now)
        return sum(self._a), sum(self._b)

    def clear(self) -> None:
        self._epoch = None


@dataclass(slots=True)
class CircuitBreaker:
    """One engine's breaker (see the module docstring)."""

    config: BreakerConfig = field(default_factory=BreakerConfig)
    rng: random.Random = field(default_factory=random.Random)
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    """Failures in a row (closed), for ``failure_threshold``."""
    successes: int = 0
    """Successes in half-open, for ``recovery_threshold``."""
    trips: int = 0
    open_until: float = 0.0
    closed_since: float = 0.0
    trials: set[str] = field(default_factory=set)
    window: SlidingWindow | None = None
    probe_trip: bool = False
    """The last opening came from a failed probe or a refused connection."""

    def __post_init__(self) -> None:
        if self.window is None:
            self.window = SlidingWindow(self.config.window_s)

    # -- routing -----------------------------------------------------------------
    def poll(self, now: float) -> Transition | None:
        """Open → half-open once the cooldown is over."""
        if self.state is BreakerState.OPEN and now >= self.open_until:
            return self._to(BreakerState.HALF_OPEN, now)
        return None

    @property
    def trial_requests(self) -> bool:
        """Half-open and testing with requests (it was opened by failed requests)."""
        return self.state is BreakerState.HALF_OPEN and not self.probe_trip

    @property
    def admits(self) -> bool:
        """Whether a request may be sent now: closed, or half-open with a free trial slot."""
        if self.state is BreakerState.CLOSED:
            return True
        return self.trial_requests and len(self.trials) < self.config.half_open_requests

    def begin(self, request_id: str) -> None:
        """A request was sent; in half-open it takes a trial slot until :meth:`end`."""
        if self.state is BreakerState.HALF_OPEN:
            self.trials.add(request_id)

    def end(self, request_id: str) -> None:
        self.trials.discard(request_id)

    # -- outcomes ------------------------------------------------------------------
    def success(self, now: float, *, probe: bool = False) -> Transition | None:
        """A request (or, ``probe``, a health probe) succeeded. A passing probe does not
        excuse failing requests: in closed state it neither resets the run of failures
        nor counts in the window; in half-open it counts like a trial request."""
        state = self.state
        if state is BreakerState.OPEN:
            return None  # too early: the cooldown stands
        if state is BreakerState.CLOSED:
            if not probe:
                self.failures = 0
                assert self.window is not None
                self.window.add(now, a=1)
            return None
        if probe and not self.probe_trip:
            return None  # requests failed: only a trial request can show they work again
        self.successes += 1
        if self.successes >= self.config.recovery_threshold:
            return self._to(BreakerState.CLOSED, now)
        return None

    def failure(
        self, now: float, *, immediate: bool = False, probe: bool = False
    ) -> Transition | None:
        """A request (or, ``probe``, a health probe) failed; ``immediate``: the engine
        refused the connection (the process is gone)."""
        state = self.state
        if state is BreakerState.OPEN:
            return None
        self.probe_trip = probe or immediate
        if state is BreakerState.HALF_OPEN:
            return self._to(BreakerState.OPEN, now)
        cfg = self.config
        self.failures += 1
        assert self.window is not None
        self.window.add(now, a=1, b=1)
        if immediate or self.failures >= cfg.failure_threshold:
            return self._to(BreakerState.OPEN, now)
        total, failed = self.window.totals(now)
        if total >= cfg.min_requests and failed >= cfg.failure_rate * total:
            return self._to(BreakerState.OPEN, now)
        return None

    def cooldown(self) -> float:
        """The cooldown of the current trip (without jitter)."""
        cfg = self.config
        return min(cfg.cooldown_max_s, cfg.cooldown_s * 2.0 ** max(0, self.trips - 1))

    def _to(self, new: BreakerState, now: float) -> Transition:
        old = self.state
        self.state = new
        self.successes = 0
        if new is BreakerState.OPEN:
            cfg = self.config
            if old is BreakerState.CLOSED and now - self.closed_since >= cfg.cooldown_max_s:
                self.trips = 0  # it had been fine for a while: start the backoff over
            self.trips += 1
            spread = 1.0 + cfg.jitter * (2.0 * self.rng.random() - 1.0) if cfg.jitter else 1.0
            self.open_until = now + self.cooldown() * spread
        elif new is BreakerState.CLOSED:
            self.failures = 0
            self.closed_since = now
            assert self.window is not None
            self.window.clear()
        self.trials.clear()
        return old, new


def breaker_config(health: HealthConfig) -> BreakerConfig:
    """The breaker settings of the ``health`` section of the gateway's configuration."""
    return BreakerConfig(
        failure_threshold=health.failure_threshold,
        recovery_threshold=health.recovery_threshold,
        cooldown_s=health.cooldown_s,
        cooldown_max_s=max(health.cooldown_s, health.cooldown_max_s),
        jitter=health.cooldown_jitter,
        failure_rate=health.failure_rate,
        window_s=health.failure_rate_window_s,
        min_requests=health.failure_rate_min_requests,
        half_open_requests=health.half_open_requests,
    )
