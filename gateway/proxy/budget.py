"""The retry budget: retries cannot multiply the load on a failing fleet.

Over a sliding window (``retries.budget_window_s``, 10 s), retries may add at
most ``budget_ratio`` (20 %) of the requests that arrived, plus
``budget_min_per_s`` (3) per second so that a quiet gateway can still retry.
When a retry would exceed the budget the request fails fast with a 503 and
``Retry-After`` instead: in a total outage the engines see about 1.2 attempts
per request rather than ``max_attempts``.
"""

from __future__ import annotations

from gateway.cluster.breaker import SlidingWindow
from gateway.config import RetryConfig
from gateway.proxy.errors import ApiError


class RetryBudget:
    """Counts requests and retries in a window; :meth:`allow_retry` spends one retry."""

    def __init__(self, ratio: float, min_per_s: float, window_s: float) -> None:
        self.ratio = ratio
        self.floor = min_per_s * window_s
        self._window = SlidingWindow(window_s)  # a: requests, b: retries
        self.exhausted = 0

    @classmethod
    def from_config(cls, cfg: RetryConfig) -> RetryBudget:
        return cls(cfg.budget_ratio, cfg.budget_min_per_s, cfg.budget_window_s)

    def request(self, now: float) -> None:
        """A client request arrived (its first attempt is free)."""
        self._window.add(now, a=1)

    def allow_retry(self, now: float) -> bool:
        """True (and the retry is counted) when the budget has room for one more."""
        requests, retries = self._window.totals(now)
        if retries + 1 > self.ratio * requests + self.floor:
            self.exhausted += 1
            return False
        self._window.add(now, b=1)
        return True


def budget_error(attempts: int, detail: str) -> ApiError:
    """The fail-fast answer when a retry is not in the budget."""
    return ApiError(
        503,
        f"engine failed after {attempts} attempt(s) and the retry budget is exhausted "
        f"(too many failures across the fleet); last error: {detail}",
        headers={"Retry-After": "1"},
    )
