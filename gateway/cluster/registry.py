"""The live engine registry: membership, health, scraped signals, router-side accounting.

Each engine has a state the router keeps: health (passive from request
failures, active from probes), the last scraped vLLM metrics, the models it
serves, and the prompt tokens the router has sent it that have not produced
a first token yet (its pending prefill estimate). :meth:`EngineRegistry.view`
turns this into the :class:`ClusterView` policies decide on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from gateway.core.types import ClusterView, EngineRole, EngineView
from gateway.policies.router_queues import RouterQueues


class Health(StrEnum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


@dataclass(slots=True)
class EngineMetrics:
    """The vLLM signals a router uses, summed over DP ranks (KV usage: the max)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    preemptions: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    hash_algo: str | None = None
    prefix_caching: bool | None = None


@dataclass(slots=True)
class EngineState:
    """One engine as the router sees it."""

    id: str
    url: str
    role: EngineRole = EngineRole.BOTH
    configured_model: str | None = None
    api_key: str | None = None
    models: tuple[str, ...] = ()
    health: Health = Health.UNKNOWN
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_error: str | None = None
    last_ok: float | None = None
    last_scrape: float | None = None
    metrics: EngineMetrics | None = None
    pending_tokens: int = 0
    down_until: float = 0.0
    retired: bool = False
    pending_by_request: dict[str, int] = field(default_factory=dict)

    @property
    def routable(self) -> bool:
        """Known models, healthy (or not yet probed), and not being removed."""
        return not self.retired and self.health is not Health.UNHEALTHY and bool(self.models)

    def serves(self, model: str | None) -> bool:
        return model is None or model in self.models


class EngineRegistry:
    """All engines, keyed by id (the base URL unless named otherwise)."""

    def __init__(
        self,
        *,
        failure_threshold: int = 2,
        recovery_threshold: int = 1,
        cooldown_s: float = 5.0,
    ) -> None:
        self._engines: dict[str, EngineState] = {}
        self.failure_threshold = failure_threshold
        self.recovery_threshold = recovery_threshold
        self.cooldown_s = cooldown_s

    def __len__(self) -> int:
        return len(self._engines)

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._engines

    def add(
        self,
        url: str,
        *,
        role: EngineRole = EngineRole.BOTH,
        model: str | None = None,
        api_key: str | None = None,
    ) -> EngineState:
        url = url.rstrip("/")
        if url in self._engines:
            raise ValueError(f"engine {url} is already registered")
        state = EngineState(
            id=url,
            url=url,
            role=role,
            configured_model=model,
            api_key=api_key,
            models=(model,) if model else (),
        )
        self._engines[url] = state
        return state

    def remove(self, engine_id: str) -> EngineState | None:
        return self._engines.pop(engine_id, None)

    def get(self, engine_id: str) -> EngineState | None:
        return self._engines.get(engine_id)

    def all(self) -> list[EngineState]:
        return list(self._engines.values())

    def models(self) -> list[str]:
        """Models served by routable engines, in first-seen order."""
        seen: dict[str, None] = {}
        for e in self._engines.values():
            if e.routable:
                for m in e.models:
                    seen.setdefault(m, None)
        return list(seen)

    # -- health ---------------------------------------------------------------
    def mark_success(self, engine_id: str, now: float) -> bool:
        """Record a successful probe or request; True when the engine just recovered.

        An engine taken out of routing comes back only after its cooldown, so a
        server whose /health answers while its requests fail does not flap.
        """
        e = self._engines.get(engine_id)
        if e is None:
            return False
        e.consecutive_failures = 0
        e.last_ok = now
        if e.health is Health.UNHEALTHY and now < e.down_until:
            return False
        e.consecutive_successes += 1
        if e.health is not Health.HEALTHY and e.consecutive_successes >= self.recovery_threshold:
            e.health = Health.HEALTHY
            e.last_error = None
            return True
        return False

    def mark_failure(
        self, engine_id: str, error: str, now: float, *, immediate: bool = False
    ) -> bool:
        """Record a failure; True when the engine was just taken out of routing.

        ``immediate`` takes it out at once (a refused connection), otherwise after
        ``failure_threshold`` consecutive failures. It stays out for ``cooldown_s``.
        """
        e = self._engines.get(engine_id)
        if e is None:
            return False
        e.consecutive_successes = 0
        e.consecutive_failures += 1
        e.last_error = error
        if e.health is not Health.UNHEALTHY and (
            immediate or e.consecutive_failures >= self.failure_threshold
        ):
            e.health = Health.UNHEALTHY
            e.down_until = now + self.cooldown_s
            return True
        return False

    # -- router-side pending prefill accounting ----------------------------------
    def add_pending(self, engine_id: str, request_id: str, tokens: int) -> None:
        e = self._engines.get(engine_id)
        if e is not None and tokens > 0:
            e.pending_by_request[request_id] = tokens
            e.pending_tokens += tokens

    def clear_pending(self, engine_id: str, request_id: str) -> None:
        e = self._engines.get(engine_id)
        if e is not None:
            e.pending_tokens -= e.pending_by_request.pop(request_id, 0)

    # -- the policies' view --------------------------------------------------------
    def view(
        self,
        in_flight: Mapping[str, int],
        *,
        model: str | None = None,
        exclude: Iterable[str] = (),
        queues: RouterQueues | None = None,
    ) -> ClusterView:
        """Engines serving ``model``; unhealthy or excluded ones are marked unhealthy."""
        excluded = set(exclude)
        views = []
        for e in self._engines.values():
            if not e.serves(model) and e.models:
                continue
            m = e.metrics
            views.append(
                EngineView(
                    id=e.id,
                    role=e.role,
                    healthy=e.routable and e.id not in excluded,
                    num_waiting=int(m.waiting) if m else 0,
                    num_running=int(m.running) if m else 0,
                    pending_prefill_tokens=e.pending_tokens,
                    kv_usage=m.kv_usage if m else 0.0,
                    kv_capacity_blocks=(m.num_gpu_blocks or 0) if m else 0,
                    in_flight=in_flight.get(e.id, 0),
                    router_queued=queues.count(e.id) if queues is not None else 0,
                    router_queued_tokens=queues.tokens(e.id) if queues is not None else 0,
                )
            )
        return ClusterView(tuple(views))
