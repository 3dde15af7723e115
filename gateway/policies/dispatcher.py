"""The dispatcher: the one place requests meet a policy, in the simulator and the gateway.

It checks there is a healthy engine, asks the policy, validates the answer,
keeps the router's in-flight count per engine, times each decision with an
injected timer, and forwards lifecycle events to the policy's hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.core.errors import NoEngineError
from gateway.core.types import ClusterView, Decision, EngineId, RequestInfo
from gateway.policies.base import Policy


class PolicyError(RuntimeError):
    """A policy returned a decision that names no usable engine (a bug in the policy)."""


@dataclass(slots=True)
class DecisionTimes:
    """Decision durations in seconds, bounded: keeps the first ``limit`` samples."""

    limit: int = 1_000_000
    samples: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        if len(self.samples) < self.limit:
            self.samples.append(seconds)


class Dispatcher:
    """Routes requests through a policy and keeps router-side accounting."""

    def __init__(
        self,
        policy: Policy,
        *,
        timer: Callable[[], float] | None = None,
        timing_limit: int = 1_000_000,
    ) -> None:
        self.policy = policy
        self._timer = timer
        self.times = DecisionTimes(limit=timing_limit)
        self.in_flight: dict[EngineId, int] = {}
        self.routed = 0

    def route(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        """Pick an engine for ``req`` and record it as in flight there."""
        if not any(e.healthy for e in view.engines):
            raise NoEngineError("no healthy engine is available")
        timer = self._timer
        if timer is None:
            decision = self.policy.decide(req, view, now)
        else:
            start = timer()
            decision = self.policy.decide(req, view, now)
            self.times.add(timer() - start)
        self._validate(decision, view)
        self.policy.on_routed(req, decision, now)
        self.in_flight[decision.engine] = self.in_flight.get(decision.engine, 0) + 1
        self.routed += 1
        return decision

    def first_token(self, req: RequestInfo, engine: EngineId, now: float) -> None:
        self.policy.on_first_token(req, engine, now)

    def finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        """The request left ``engine`` (completed when ``ok``, failed or cancelled otherwise)."""
        count = self.in_flight.get(engine, 0)
        if count <= 1:
            self.in_flight.pop(engine, None)
        else:
            self.in_flight[engine] = count - 1
        self.policy.on_finished(req, engine, now, ok)

    def cache_event(self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]) -> None:
        if self.policy.wants_cache_events and (stored or removed):
            self.policy.on_cache_event(engine, stored, removed)

    def engine_removed(self, engine: EngineId) -> None:
        self.in_flight.pop(engine, None)
        self.policy.on_engine_removed(engine)

    @staticmethod
    def _validate(decision: Decision, view: ClusterView) -> None:
        for engine_id in (decision.engine, decision.prefill_engine):
            if engine_id is None:
                continue
            engine = view.get(engine_id)
            if engine is None or not engine.healthy:
                raise PolicyError(f"policy chose {engine_id!r}, which is not a healthy engine")
