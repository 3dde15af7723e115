"""The live engine registry: membership, health, scraped signals, router-side accounting.

Each engine has a state the router keeps: health (passive from request
failures, active from probes), the last scraped vLLM metrics, the models it
serves (base models and LoRA adapters, re-read by the monitor), the adapters of
the requests it has in flight there, and the prompt tokens the router has sent
it that have not produced a first token yet (its pending prefill estimate). A
scrape's running and waiting counts lose the attempts that ended after it.
:meth:`EngineRegistry.view` turns this into the :class:`ClusterView` policies decide on.

Health is a circuit breaker per engine (:mod:`gateway.cluster.breaker`): request
failures and failed probes open it, a cooldown with jittered exponential backoff
keeps the engine out, then half-open admits a bounded number of trial requests
while probes go on, and successes close it. ``health`` mirrors it: ``unhealthy``
while open or half-open, ``healthy`` once closed after a success.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from gateway.cluster.breaker import BreakerConfig, BreakerState, CircuitBreaker, Transition
from gateway.cluster.replica_sync import PeerLoad
from gateway.core.types import ClusterView, EngineRole, EngineView
from gateway.policies.router_queues import RouterQueues

log = logging.getLogger("kvgate.cluster")


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
    max_lora: int | None = None
    """``--max-loras`` from ``vllm:lora_requests_info``; None when the engine exports none."""
    lora_running: tuple[str, ...] = ()
    """Adapters with requests running in the engine's batch (its latest sample)."""
    lora_waiting: tuple[str, ...] = ()
    """Adapters with requests waiting in the engine's queue (its latest sample)."""


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A LoRA adapter an engine lists in ``/v1/models`` (``parent``: its base model,
    ``root``: the path vLLM loaded it from, which enters vLLM's block hashes)."""

    name: str
    base: str
    path: str = ""


MAX_LORA_REQUESTS_TRACKED = 65_536
"""In-flight requests per engine whose adapter the registry remembers (beyond: not counted)."""


@dataclass(slots=True)
class EngineState:
    """One engine as the router sees it."""

    id: str
    url: str
    role: EngineRole = EngineRole.BOTH
    configured_model: str | None = None
    api_key: str | None = None
    models: tuple[str, ...] = ()
    """Every model name the engine serves: base models and LoRA adapters."""
    lora: dict[str, LoraAdapter] = field(default_factory=dict)
    """The adapters among ``models``, by name."""
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
    pending_since: dict[str, float] = field(default_factory=dict)
    """When each pending request was routed here (flow control's drain estimate)."""
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    lora_by_request: dict[str, str] = field(default_factory=dict)
    """The adapter of each request this gateway has in flight on the engine (bounded:
    :data:`MAX_LORA_REQUESTS_TRACKED`)."""
    models_checked: float | None = None
    """When ``/v1/models`` was last read (successfully or not); None before the first read."""
    models_stale: bool = False
    """Re-read ``/v1/models`` at the next monitor round (the engine answered 404 for a model)."""
    model_refreshes: int = 0
    """Reads of ``/v1/models`` that succeeded."""
    model_refresh_failures: int = 0
    attempts_since: dict[str, float] = field(default_factory=dict)
    """When each attempt this gateway has in flight on the engine began (bounded:
    :data:`MAX_LORA_REQUESTS_TRACKED`)."""
    left_since_scrape: int = 0
    """Attempts that began before the latest scrape and ended after it: the scrape still
    counts them as running or waiting (see :meth:`observe`)."""

    def observe(self, metrics: EngineMetrics, now: float) -> None:
        """A new scrape: its counts include every attempt in flight until now."""
        self.metrics = metrics
        self.last_scrape = now
        self.left_since_scrape = 0

    def live_counts(self) -> tuple[int, int]:
        """(running, waiting) as of now: the scrape's, less the attempts that ended since
        (running first, then waiting). A scrape lags by up to the monitor's interval; a
        request that finished after it would otherwise keep its engine looking busy, and
        sequential clients would all be sent to the engine scraped last."""
        if self.metrics is None:
            return 0, 0
        running, waiting = int(self.metrics.running), int(self.metrics.waiting)
        gone = min(self.left_since_scrape, running + waiting)
        from_running = min(gone, running)
        return running - from_running, waiting - (gone - from_running)

    def live_kv_usage(self) -> float:
        """The scrape's KV use, scaled by the share of its running requests still running
        (see :meth:`live_counts`): blocks a finished request held are free again, and a
        stale figure would keep the engine last seen busy looking fuller than the others."""
        m = self.metrics
        if m is None:
            return 0.0
        scraped = int(m.running)
        if scraped <= 0:
            return m.kv_usage
        running, _ = self.live_counts()
        return m.kv_usage * min(running, scraped) / scraped

    def lora_resident(self) -> frozenset[str]:
        """Adapters in the engine's batch as last scraped, plus those of requests this
        gateway has in flight there (known before the next scrape)."""
        m = self.metrics
        scraped = (*m.lora_running, *m.lora_waiting) if m is not None else ()
        if not scraped and not self.lora_by_request:
            return frozenset()
        return frozenset(scraped).union(self.lora_by_request.values())

    @property
    def routable(self) -> bool:
        """Known models, healthy (or not yet probed, or half-open taking trial requests),
        and not being removed."""
        return (
            not self.retired
            and bool(self.models)
            and (self.health is not Health.UNHEALTHY or self.breaker.trial_requests)
        )

    @property
    def admits(self) -> bool:
        """Routable and free to take a request now (half-open: a trial slot is free)."""
        return self.routable and (self.health is not Health.UNHEALTHY or self.breaker.admits)

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
        breaker: BreakerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
    ) -> None:
        self._engines: dict[str, EngineState] = {}
        self.breaker = breaker or BreakerConfig(
            failure_threshold=failure_threshold,
            recovery_threshold=recovery_threshold,
            cooldown_s=cooldown_s,
            cooldown_max_s=max(cooldown_s, 60.0),
        )
        self.failure_threshold = self.breaker.failure_threshold
        self.recovery_threshold = self.breaker.recovery_threshold
        self.cooldown_s = self.breaker.cooldown_s
        self.clock = clock
        self._rng = random.Random(seed)
        self.on_transition: Callable[[EngineState, BreakerState, BreakerState], None] | None = None
        """Called on every breaker transition (metrics, logs)."""
        self.peers: PeerLoad | None = None
        """The other gateway replicas' load (replica sync); added to ours in :meth:`view`."""
        self.on_load_change: Callable[[], None] | None = None
        """Called when a request's prompt is added to or cleared from pending prefill."""

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
            breaker=CircuitBreaker(self.breaker, random.Random(self._rng.random())),
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
        self.poll()
        seen: dict[str, None] = {}
        for e in self._engines.values():
            if e.routable:
                for m in e.models:
                    seen.setdefault(m, None)
        return list(seen)

    def lora_adapter(self, model: str | None) -> LoraAdapter | None:
        """The adapter ``model`` names on some engine, or None for a base model."""
        if not model:
            return None
        for e in self._engines.values():
            adapter = e.lora.get(model)
            if adapter is not None:
                return adapter
        return None

    def known_models(self) -> set[str]:
        """Models any registered engine serves or served, routable or not."""
        return {m for e in self._engines.values() for m in e.models}

    # -- health (the breaker) --------------------------------------------------------
    def poll(self, now: float | None = None) -> None:
        """Move engines whose cooldown is over to half-open."""
        now = self.clock() if now is None else now
        for e in self._engines.values():
            if e.breaker.state is BreakerState.OPEN and now >= e.breaker.open_until:
                self._apply(e, e.breaker.poll(now), now)

    def mark_success(self, engine_id: str, now: float, *, probe: bool = False) -> bool:
        """Record a successful probe or request; True when the engine just recovered.

        An engine taken out of routing comes back only after its cooldown (then
        half-open: ``recovery_threshold`` successes close the breaker), so a server
        whose /health answers while its requests fail does not flap quickly. A passing
        ``probe`` does not reset the failures of requests (see the breaker).
        """
        e = self._engines.get(engine_id)
        if e is None:
            return False
        b = e.breaker
        was = e.health
        self._apply(e, b.poll(now), now)
        e.last_ok = now
        self._apply(e, b.success(now, probe=probe), now)
        e.consecutive_failures = b.failures
        if b.state is not BreakerState.CLOSED:
            e.consecutive_successes = b.successes
            return False
        e.consecutive_successes += 1
        if e.health is not Health.HEALTHY and e.consecutive_successes >= self.recovery_threshold:
            e.health = Health.HEALTHY  # first probe(s) of a new engine
            e.last_error = None
        return was is not Health.HEALTHY and e.health is Health.HEALTHY

    def mark_failure(
        self,
        engine_id: str,
        error: str,
        now: float,
        *,
        immediate: bool = False,
        probe: bool = False,
    ) -> bool:
        """Record a failure; True when the engine was just taken out of routing.

        ``immediate`` takes it out at once (a refused connection), otherwise after
        ``failure_threshold`` consecutive failures or a failure rate over the
        breaker's window. It stays out for the breaker's cooldown.
        """
        e = self._engines.get(engine_id)
        if e is None:
            return False
        b = e.breaker
        self._apply(e, b.poll(now), now)
        e.consecutive_successes = 0
        e.last_error = error
        change = b.failure(now, immediate=immediate, probe=probe)
        self._apply(e, change, now)
        e.consecutive_failures = max(b.failures, 1)
        return change is not None and change[1] is BreakerState.OPEN

    def begin_attempt(self, engine_id: str, request_id: str, lora: str = "") -> None:
        """A request goes to the engine; in half-open it holds a trial slot until
        :meth:`end_attempt` (call both; the end is idempotent). ``lora``: the request's
        adapter, which counts as resident on the engine until the end."""
        e = self._engines.get(engine_id)
        if e is not None:
            e.breaker.begin(request_id)
            if len(e.attempts_since) < MAX_LORA_REQUESTS_TRACKED:
                e.attempts_since.setdefault(request_id, self.clock())
            if lora and len(e.lora_by_request) < MAX_LORA_REQUESTS_TRACKED:
                e.lora_by_request[request_id] = lora

    def end_attempt(self, engine_id: str, request_id: str) -> None:
        e = self._engines.get(engine_id)
        if e is not None:
            e.breaker.end(request_id)
            e.lora_by_request.pop(request_id, None)
            began = e.attempts_since.pop(request_id, None)
            if began is not None and e.last_scrape is not None and began <= e.last_scrape:
                e.left_since_scrape += 1

    def retry_after(self, now: float) -> int:
        """Seconds until the first open engine turns half-open (1 when none is open)."""
        waits = [
            e.breaker.open_until - now
            for e in self._engines.values()
            if e.breaker.state is BreakerState.OPEN and not e.retired
        ]
        return max(1, min(60, math.ceil(min(waits)))) if waits else 1

    def _apply(self, e: EngineState, change: Transition | None, now: float) -> None:
        if change is None:
            return
        old, new = change
        if new is BreakerState.OPEN:
            e.health = Health.UNHEALTHY
            e.down_until = e.breaker.open_until
        elif new is BreakerState.CLOSED:
            e.health = Health.HEALTHY
            e.last_error = None
        log.info(
            "engine %s circuit %s -> %s",
            e.id,
            old.value,
            new.value,
            extra={
                "engine": e.id,
                "breaker": new.value,
                "trips": e.breaker.trips,
                "open_s": round(max(0.0, e.breaker.open_until - now), 3),
            },
        )
        if self.on_transition is not None:
            self.on_transition(e, old, new)

    # -- router-side pending prefill accounting ----------------------------------
    def add_pending(self, engine_id: str, request_id: str, tokens: int) -> None:
        e = self._engines.get(engine_id)
        if e is not None and tokens > 0:
            e.pending_by_request[request_id] = tokens
            e.pending_tokens += tokens
            e.pending_since[request_id] = self.clock()
        if self.on_load_change is not None:  # a routed request: the peers hear of it now
            self.on_load_change()

    def clear_pending(self, engine_id: str, request_id: str) -> None:
        e = self._engines.get(engine_id)
        if e is not None:
            e.pending_tokens -= e.pending_by_request.pop(request_id, 0)
            e.pending_since.pop(request_id, None)
        if self.on_load_change is not None:
            self.on_load_change()

    def pending_log(self, engine_id: str) -> list[tuple[float, int]]:
        """This replica's pending requests on ``engine_id``: (seconds since routed, tokens),
        oldest first."""
        e = self._engines.get(engine_id)
        if e is None:
            return []
        now, since = self.clock(), e.pending_since
        ages = ((now - since.get(r, now), n) for r, n in e.pending_by_request.items())
        return sorted(ages, reverse=True)

    # -- the policies' view --------------------------------------------------------
    def view(
        self,
        in_flight: Mapping[str, int],
        *,
        model: str | None = None,
        exclude: Iterable[str] = (),
        queues: RouterQueues | None = None,
    ) -> ClusterView:
        """Engines serving ``model``; unhealthy, excluded and half-open engines without a
        free trial slot are marked unhealthy. With replica sync, ``in_flight`` and
        ``pending_prefill_tokens`` are this replica's plus its live peers' (as of their
        last snapshot)."""
        self.poll()
        excluded = set(exclude)
        views = []
        peers = self.peers
        for e in self._engines.values():
            if not e.serves(model) and e.models:
                continue
            peer_n, peer_tokens = peers.of(e.id) if peers is not None else (0, 0)
            m = e.metrics
            running, waiting = e.live_counts()
            views.append(
                EngineView(
                    id=e.id,
                    role=e.role,
                    healthy=e.admits and e.id not in excluded,
                    num_waiting=waiting,
                    num_running=running,
                    pending_prefill_tokens=e.pending_tokens + peer_tokens,
                    kv_usage=e.live_kv_usage(),
                    kv_capacity_blocks=(m.num_gpu_blocks or 0) if m else 0,
                    in_flight=in_flight.get(e.id, 0) + peer_n,
                    router_queued=queues.count(e.id) if queues is not None else 0,
                    router_queued_tokens=queues.tokens(e.id) if queues is not None else 0,
                    lora_resident=e.lora_resident(),
                    max_lora=(m.max_lora or 0) if m else 0,
                )
            )
        return ClusterView(tuple(views))
