"""Routing policies behind one interface, and the dispatcher that drives them."""

from gateway.policies.base import Policy, PolicyBase, PolicyContext
from gateway.policies.dispatcher import Dispatcher, PolicyError
from gateway.policies.registry import POLICIES, create_policy, policy_names

__all__ = [
    "POLICIES",
    "Dispatcher",
    "Policy",
    "PolicyBase",
    "PolicyContext",
    "PolicyError",
    "create_policy",
    "policy_names",
]
