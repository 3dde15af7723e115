"""The policy seam: one interface for every routing policy.

A policy decides where a request runs from a :class:`ClusterView` and the
clock reading it is given; it never does I/O, never awaits and never reads a
clock of its own. Its state changes only in the hooks (``on_routed`` and the
rest), which the dispatcher calls in the simulator and the gateway alike.
``decide`` may draw from the policy's injected, seeded RNG.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from gateway.core.errors import ConfigError
from gateway.core.types import ClusterView, Decision, EngineId, EngineView, Migration, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.policies.pd_rule import PDSettings
from gateway.policies.router_queues import QueuedRequest, RouterQueues


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy is built with: a seed for its RNG, the block size, a perf model.

    ``kv_events`` says the driver delivers the engines' KV cache events
    (``on_cache_event`` / ``on_cache_reset``): every policy that keeps prefix
    state then builds it from those events as well as from its own routing, so
    that gateway replicas agree on what each engine holds.
    ``pd`` holds the thresholds of the P/D rule (:mod:`gateway.policies.pd_rule`) that
    ``pd_native`` policies apply (the dispatcher applies the same rule in pair mode).
    """

    seed: int = 0
    block_size: int = 16
    perf: PerfModel | None = None
    kv_events: bool = False
    pd: PDSettings = field(default_factory=PDSettings)

    def rng(self, salt: str = "") -> random.Random:
        """A private RNG, seeded from the context seed and ``salt``."""
        return random.Random(f"{self.seed}:{salt}")


@runtime_checkable
class Policy(Protocol):
    """What the dispatcher calls. :class:`PolicyBase` gives no-op hooks."""

    name: str
    wants_cache_events: bool
    may_hold: bool
    pd_native: bool

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision: ...
    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None: ...
    def on_first_token(self, req: RequestInfo, engine: EngineId, now: float) -> None: ...
    def on_finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None: ...
    def on_cache_event(
        self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]
    ) -> None: ...
    def on_engine_removed(self, engine: EngineId) -> None: ...
    def on_membership(self, engines: Sequence[EngineId]) -> None: ...
    def on_prefill_done(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None: ...
    def on_cache_reset(self, engine: EngineId) -> None: ...
    def can_dispatch(
        self, engine: EngineView, pending_tokens: int, item: QueuedRequest
    ) -> bool: ...
    def rebalance(self, queues: RouterQueues, view: ClusterView, now: float) -> list[Migration]: ...


class PolicyBase:
    """Base class with no-op hooks, so a stateless policy is only ``decide``."""

    name: ClassVar[str] = "base"
    wants_cache_events: bool = False
    """True when the policy wants the engines' KV cache events (``on_cache_event``)."""
    may_hold: bool = False
    """True when ``decide`` may return ``hold`` (drivers then watch for clients leaving)."""
    pd_native: ClassVar[bool] = False
    """True when ``decide`` picks (prefill, decode) pairs itself in disaggregated clusters;
    otherwise the dispatcher asks ``decide`` once per pool."""

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        raise NotImplementedError

    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        return None

    def on_first_token(self, req: RequestInfo, engine: EngineId, now: float) -> None:
        return None

    def on_finished(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        return None

    def on_cache_event(
        self, engine: EngineId, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        return None

    def on_engine_removed(self, engine: EngineId) -> None:
        return None

    def on_membership(self, engines: Sequence[EngineId]) -> None:
        """The set of engines (healthy or not) changed; called before ``decide``."""
        return None

    def on_prefill_done(self, req: RequestInfo, engine: EngineId, now: float, ok: bool) -> None:
        """The prefill leg of a disaggregated request left ``engine``."""
        return None

    def on_cache_reset(self, engine: EngineId) -> None:
        """``engine`` dropped its whole prefix cache, or its events were lost: forget it."""
        return None

    def can_dispatch(self, engine: EngineView, pending_tokens: int, item: QueuedRequest) -> bool:
        """May a request held for ``engine`` go now? (Only policies that hold requests.)"""
        return True

    def rebalance(self, queues: RouterQueues, view: ClusterView, now: float) -> list[Migration]:
        """Moves of held requests between engine queues (hotspot rebalancing)."""
        return []


C = TypeVar("C")


def build_config(cls: type[C], options: Mapping[str, Any] | None, policy: str) -> C:
    """Build a policy's config dataclass, naming unknown or ill-typed options."""
    options = dict(options or {})
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(known))
    if unknown:
        allowed = ", ".join(sorted(known)) or "none"
        raise ConfigError(
            f"policy {policy!r}: unknown option(s) {', '.join(unknown)} (allowed: {allowed})"
        )
    converted: dict[str, Any] = {}
    for key, value in options.items():
        default = known[key].default
        converted[key] = _coerce(value, None if default is MISSING else default, policy, key)
    try:
        return cls(**converted)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"policy {policy!r}: {exc}") from None


def _coerce(value: Any, default: Any, policy: str, key: str) -> Any:
    if default is None or not isinstance(value, str):
        return value
    try:
        if isinstance(default, bool):
            if value.lower() in {"1", "true", "yes", "on"}:
                return True
            if value.lower() in {"0", "false", "no", "off"}:
                return False
            raise ValueError(value)
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        raise ConfigError(
            f"policy {policy!r}: option {key}={value!r} is not a valid {type(default).__name__}"
        ) from None
    return value
