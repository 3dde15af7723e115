"""Round robin: each request goes to the next healthy engine in turn.

Algorithm: keep a counter; pick ``healthy[counter % len(healthy)]``; the
counter advances in ``on_routed``, once per request (in a disaggregated pool the
dispatcher reports a request's prefill and decode engines: both pools rotate).
No knobs. The baseline every comparison includes (Kubernetes ClusterIP / vLLM DP
without cache awareness).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gateway.core.types import ClusterView, Decision, RequestInfo
from gateway.policies.base import PolicyBase, PolicyContext


@dataclass(frozen=True, slots=True)
class RoundRobinConfig:
    """Round robin has no knobs."""


class RoundRobinPolicy(PolicyBase):
    name: ClassVar[str] = "round_robin"

    def __init__(self, ctx: PolicyContext, config: RoundRobinConfig | None = None) -> None:
        self.config = config or RoundRobinConfig()
        self._counter = 0
        self._last: tuple[str, float] = ("", -1.0)  # (id, arrival) of the last request

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        healthy = view.healthy()
        return Decision(engine=healthy[self._counter % len(healthy)].id, reason="round_robin")

    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        if (req.id, req.arrival) != self._last:
            self._counter += 1
            self._last = (req.id, req.arrival)
