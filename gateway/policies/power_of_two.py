"""Power of two choices: sample two engines at random, take the less loaded.

Algorithm: draw two distinct healthy engines uniformly from the policy's
seeded RNG and pick the one with fewer pending prefill tokens (then fewer
in-flight requests, then the first drawn). With one engine, take it. No knobs.
Source: Mitzenmacher's "power of two choices"; SMG's ``power_of_two``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gateway.core.types import ClusterView, Decision, RequestInfo
from gateway.policies.base import PolicyBase, PolicyContext
from gateway.policies.least_loaded import load_key


@dataclass(frozen=True, slots=True)
class PowerOfTwoConfig:
    """Power of two has no knobs."""


class PowerOfTwoPolicy(PolicyBase):
    name: ClassVar[str] = "power_of_two"

    def __init__(self, ctx: PolicyContext, config: PowerOfTwoConfig | None = None) -> None:
        self.config = config or PowerOfTwoConfig()
        self._rng = ctx.rng(self.name)

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        healthy = view.healthy()
        if len(healthy) == 1:
            return Decision(engine=healthy[0].id, reason="power_of_two:single")
        a, b = self._rng.sample(range(len(healthy)), 2)
        pick = healthy[b] if load_key(healthy[b]) < load_key(healthy[a]) else healthy[a]
        return Decision(engine=pick.id, reason="power_of_two")
