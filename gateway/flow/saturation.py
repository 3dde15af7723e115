"""When are the engines saturated? Flow control holds requests only then.

An engine is saturated when any of these holds (each off at 0):

* ``max_waiting``: it reports at least this many requests waiting (``vllm:num_requests_waiting``,
  as last scraped);
* ``max_kv_usage``: its KV cache is at least this full (``vllm:kv_cache_usage_perc``);
* ``max_ttft_s``: the prefill queued ahead of a new request (the router's own pending prefill
  tokens plus its router queue, priced by the engine performance model as
  :func:`gateway.policies.ttft_estimate.wait_s` does) would take longer than the request's SLO
  TTFT target, capped at ``max_ttft_s`` (so a batch class with a 60 s target still does not
  fill the engines' queues).

**A mix of priorities**: while more than one priority has arrived within the last
``protect_window_s`` seconds, every request's queueing limit is also capped at
``protect_ttft_s``: requests wait at the gateway, in priority order, as soon as the engines
have about one prefill queued, so a better-priority arrival overtakes the worse ones there
instead of queuing behind them in an engine, and is bound to the engine that frees first.
With one priority there is nothing to protect and the thresholds above apply unchanged
(an engine keeps a deep queue, no capacity is lost). :class:`RecentPriorities` remembers
the priorities seen (the controller feeds it every arrival).

The pool is saturated for a request when every healthy engine is. Without a healthy engine it
is not (the dispatcher answers 503 then). Pure: the caller passes the view.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.core.types import ClusterView, EngineView, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.policies.ttft_estimate import wait_s


@dataclass(frozen=True, slots=True)
class SaturationSettings:
    """Thresholds of the saturation detector (0 turns one off)."""

    max_waiting: int = 8
    max_kv_usage: float = 0.95
    max_ttft_s: float = 2.0
    protect_ttft_s: float = 0.05
    """The queueing limit while priorities are mixed (0: off)."""
    protect_window_s: float = 30.0
    """How long a priority's last arrival counts towards a mix."""

    def __post_init__(self) -> None:
        values = (
            self.max_waiting,
            self.max_kv_usage,
            self.max_ttft_s,
            self.protect_ttft_s,
            self.protect_window_s,
        )
        if min(values) < 0:
            raise ValueError("saturation thresholds must be >= 0")


def drained_tokens(
    log: Iterable[tuple[float, int]], now: float, prefill_s: Callable[[int], float]
) -> int:
    """Prompt tokens of the requests in ``log`` (each one's dispatch time and prompt tokens,
    in dispatch order) whose prefill is not done at ``now`` if the engine prefilled them one
    after another, first come first served, each taking ``prefill_s(tokens)``. The gateway
    learns that a prefill is done from the first token, which a non-streamed request shows
    only with its whole answer; this bounds its estimate."""
    free = -math.inf
    out: list[tuple[float, int]] = []
    for at, tokens in log:
        free = max(free, at) + prefill_s(tokens)
        out.append((free, tokens))
    return sum(tokens for done, tokens in out if done > now)


class RecentPriorities:
    """When each priority last arrived, to tell a mix of priorities (bounded: past
    ``limit`` priorities the ones outside the window and then the worst are forgotten;
    two remembered still make a mix)."""

    def __init__(self, window_s: float, limit: int = 16) -> None:
        self.window_s = window_s
        self.limit = limit
        self._last: dict[int, float] = {}

    def saw(self, priority: int, now: float) -> None:
        self._last[priority] = now
        if len(self._last) > self.limit:
            old = [p for p, t in self._last.items() if now - t > self.window_s]
            for p in old:
                del self._last[p]
            while len(self._last) > self.limit:
                del self._last[max(self._last)]

    def mixed(self, now: float) -> bool:
        """Whether more than one priority arrived within the window."""
        return sum(now - t <= self.window_s for t in self._last.values()) > 1


class SaturationDetector:
    """Says whether the engines of a view can take one more request now."""

    def __init__(self, settings: SaturationSettings, perf: PerfModel) -> None:
        self.settings = settings
        self.perf = perf

    def ttft_limit(self, req: RequestInfo | None, *, mixed: bool = False) -> float:
        """The queueing delay a request may meet at an engine: min(SLO TTFT, max_ttft_s),
        and at most ``protect_ttft_s`` when priorities are ``mixed`` (0: no limit)."""
        cap = self.settings.max_ttft_s
        limit = min(req.slo.ttft_s, cap) if req is not None and cap > 0 else cap
        protect = self.settings.protect_ttft_s
        if mixed and protect > 0:
            return min(limit, protect) if limit > 0 else protect
        return limit

    def engine_reason(self, engine: EngineView, limit_s: float) -> str | None:
        """Why ``engine`` is saturated (``waiting``, ``kv``, ``ttft``), or None."""
        s = self.settings
        if s.max_waiting and engine.num_waiting >= s.max_waiting:
            return "waiting"
        if s.max_kv_usage and engine.kv_usage >= s.max_kv_usage:
            return "kv"
        if limit_s > 0 and wait_s(self.perf, engine) > limit_s:
            return "ttft"
        return None

    def reason(
        self, view: ClusterView, req: RequestInfo | None = None, *, mixed: bool = False
    ) -> str | None:
        """Why the pool is saturated for ``req`` (the first engine's reason), or None;
        ``mixed``: several priorities arrived recently (:class:`RecentPriorities`)."""
        limit = self.ttft_limit(req, mixed=mixed)
        first: str | None = None
        for engine in view.engines:
            if not engine.healthy:
                continue
            why = self.engine_reason(engine, limit)
            if why is None:
                return None
            first = first or why
        return first
