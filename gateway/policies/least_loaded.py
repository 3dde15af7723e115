"""Least loaded: the engine with the fewest pending prefill tokens.

Algorithm: argmin over healthy engines of (pending prefill tokens, in-flight
requests), ties broken by a rotating start so equal engines share traffic (it
rotates once per request, so both pools of a disaggregated cluster rotate).
Pending prefill tokens are the uncached prompt tokens queued or still being
prefilled (exact in the simulator; the router's estimate in the gateway).
No knobs. Source: the "least loaded" baseline of Preble and DualMap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gateway.core.types import ClusterView, Decision, EngineView, RequestInfo
from gateway.policies.base import PolicyBase, PolicyContext


@dataclass(frozen=True, slots=True)
class LeastLoadedConfig:
    """Least loaded has no knobs."""


def load_key(engine: EngineView) -> tuple[int, int]:
    """The load order shared by the load-based baselines."""
    return (engine.pending_prefill_tokens, engine.in_flight)


class LeastLoadedPolicy(PolicyBase):
    name: ClassVar[str] = "least_loaded"

    def __init__(self, ctx: PolicyContext, config: LeastLoadedConfig | None = None) -> None:
        self.config = config or LeastLoadedConfig()
        self._offset = 0
        self._last: tuple[str, float] = ("", -1.0)  # (id, arrival) of the last request

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        healthy = view.healthy()
        n = len(healthy)
        best = min(range(n), key=lambda i: (*load_key(healthy[i]), (i - self._offset) % n))
        return Decision(engine=healthy[best].id, reason="least_loaded")

    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        if (req.id, req.arrival) != self._last:
            self._offset += 1
            self._last = (req.id, req.arrival)
