"""Policy names and how to build them. Registry key = module name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from gateway.core.errors import ConfigError
from gateway.policies.base import Policy, PolicyContext, build_config
from gateway.policies.cache_aware import CacheAwareConfig, CacheAwarePolicy
from gateway.policies.cost_model import CostModelConfig, CostModelPolicy
from gateway.policies.dualmap import DualMapConfig, DualMapPolicy
from gateway.policies.kv_cost import KvCostConfig, KvCostPolicy
from gateway.policies.least_loaded import LeastLoadedConfig, LeastLoadedPolicy
from gateway.policies.length_heuristic import LengthHeuristicConfig, LengthHeuristicPolicy
from gateway.policies.power_of_two import PowerOfTwoConfig, PowerOfTwoPolicy
from gateway.policies.preble import PrebleConfig, PreblePolicy
from gateway.policies.predicted_ttft import PredictedTtftConfig, PredictedTtftPolicy
from gateway.policies.round_robin import RoundRobinConfig, RoundRobinPolicy
from gateway.policies.weighted_scorer import WeightedScorerConfig, WeightedScorerPolicy

PolicyFactory = Callable[[PolicyContext, Mapping[str, Any] | None], Policy]


def _factory(policy_cls: Any, config_cls: Any) -> PolicyFactory:
    def make(ctx: PolicyContext, options: Mapping[str, Any] | None) -> Policy:
        config = build_config(config_cls, options, policy_cls.name)
        policy: Policy = policy_cls(ctx, config)
        return policy

    return make


POLICIES: Mapping[str, PolicyFactory] = MappingProxyType(
    {
        "round_robin": _factory(RoundRobinPolicy, RoundRobinConfig),
        "least_loaded": _factory(LeastLoadedPolicy, LeastLoadedConfig),
        "power_of_two": _factory(PowerOfTwoPolicy, PowerOfTwoConfig),
        "cache_aware": _factory(CacheAwarePolicy, CacheAwareConfig),
        "weighted_scorer": _factory(WeightedScorerPolicy, WeightedScorerConfig),
        "kv_cost": _factory(KvCostPolicy, KvCostConfig),
        "preble": _factory(PreblePolicy, PrebleConfig),
        "dualmap": _factory(DualMapPolicy, DualMapConfig),
        "cost_model": _factory(CostModelPolicy, CostModelConfig),
        "length_heuristic": _factory(LengthHeuristicPolicy, LengthHeuristicConfig),
        "predicted_ttft": _factory(PredictedTtftPolicy, PredictedTtftConfig),
    }
)
"""Every policy kvgate ships, by registry key."""


def policy_names() -> list[str]:
    return list(POLICIES)


def create_policy(
    name: str, ctx: PolicyContext | None = None, options: Mapping[str, Any] | None = None
) -> Policy:
    """Build the policy ``name``; unknown names and options raise :class:`ConfigError`."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    return factory(ctx or PolicyContext(), options)
