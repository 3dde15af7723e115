"""The routing service: everything a front end routes with, built once (:class:`RoutingService`).

Engines and their health (registry, monitor, Kubernetes discovery), the policy and its
dispatcher (router queues, hooks, the queue pump), routing keys (text and token keyers),
KV events, replica sync, the traffic recorder, the stored-response table, session
bindings, the client rate limiter and the metrics. It knows no HTTP server: the HTTP proxy
(:func:`gateway.proxy.app.create_app`) and the Envoy endpoint picker (:mod:`gateway.epp`)
are two front ends over one instance. ``__init__`` only builds objects (no I/O);
:meth:`RoutingService.start` probes the engines and starts the background tasks;
:meth:`RoutingService.stop` ends them and flushes the recorder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx

from gateway.cluster.breaker import breaker_config
from gateway.cluster.discovery import Discovery, RegistryMembership, create_discovery
from gateway.cluster.kv_events import KVEventSubscriber
from gateway.cluster.monitor import EngineMonitor
from gateway.cluster.registry import EngineRegistry, EngineState
from gateway.cluster.replica_sync import NatsReplicaSync, PeerLoad, default_replica_id
from gateway.config import Settings
from gateway.core.errors import ConfigError
from gateway.core.types import EngineRole, SloClass
from gateway.observability import GatewayMetrics
from gateway.perfmodel.presets import load_preset
from gateway.policies.base import PolicyContext
from gateway.policies.dispatcher import Dispatcher, PDSettings
from gateway.policies.registry import create_policy
from gateway.policies.router_queues import RouterQueues
from gateway.policies.session_affinity import SessionAffinity
from gateway.proxy.decision_log import record_decisions
from gateway.proxy.errors import ApiError
from gateway.proxy.flow_gate import FlowGate, build_flow_gate
from gateway.proxy.kv_bridge import EventBridge
from gateway.proxy.pump import QueuePump
from gateway.proxy.ratelimit import RateLimiter, build_limiter
from gateway.proxy.recorder import Recorder
from gateway.proxy.response_store import ResponseStore
from gateway.proxy.routing_key import RoutingKeyer
from gateway.proxy.sessions import session_affinity
from gateway.proxy.token_keys import TokenKeyer
from gateway.proxy.upstream import HttpUpstream, HttpxUpstream, Timeouts, Upstream

log = logging.getLogger("kvgate")

PUMP_INTERVAL_S = 0.05
"""How often held requests are reconsidered when no request of ours completes."""


def build_client(
    settings: Settings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """The one shared control-plane client (health, models, tokenize, KV replay): explicit
    timeouts (never httpx's 5 s default)."""
    t = settings.timeouts
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=t.connect_s, read=t.read_s, write=t.write_s, pool=t.pool_s),
        limits=httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_connections,
        ),
        transport=transport,
        follow_redirects=False,
        trust_env=False,
    )


def build_recorder(settings: Settings, metrics: GatewayMetrics) -> Recorder | None:
    """The traffic recorder of ``settings.record`` (started), or None when it is off."""
    cfg = settings.record
    if cfg.path is None:
        return None
    recorder = Recorder(
        cfg.path,
        max_bytes=cfg.max_bytes,
        backups=cfg.backups,
        salt=cfg.salt.get_secret_value() if cfg.salt is not None else None,
        queue_size=cfg.queue_size,
        registry=metrics.registry,
    )
    try:
        recorder.start()
    except OSError as exc:
        raise ConfigError(f"cannot record to {cfg.path}: {exc.strerror or exc}") from None
    log.info(
        "recording traffic",
        extra={"path": cfg.path, "salted": "configured" if cfg.salt else "random"},
    )
    return recorder


def start_replica_sync(
    settings: Settings, registry: EngineRegistry, dispatcher: Dispatcher
) -> NatsReplicaSync | None:
    """Share this replica's load with its peers (``replica_sync.nats_url``), or None."""
    cfg = settings.replica_sync
    if cfg.nats_url is None:
        return None
    peers = PeerLoad(cfg.replica_id or default_replica_id(), ttl_s=cfg.ttl_s)
    registry.peers = peers

    def local() -> dict[str, tuple[int, int]]:
        flying = dispatcher.in_flight
        return {e.id: (flying.get(e.id, 0), e.pending_tokens) for e in registry.all()}

    sync = NatsReplicaSync(
        cfg.nats_url,
        local,
        peers,
        subject=cfg.subject,
        interval_s=cfg.interval_s,
        heartbeat_s=cfg.heartbeat_s,
    )
    registry.on_load_change = sync.poke
    sessions = dispatcher.sessions
    if sessions is not None:  # a session bound here is bound on every replica
        sync.share_table("session", sessions.table)
        sessions.on_bind = lambda key, engine, ttl_s: sync.publish_binding(
            "session", key, engine, ttl_s
        )
    sync.start()
    return sync


class RoutingService:
    """One gateway's routing state and background tasks; front ends share it."""

    def __init__(
        self,
        settings: Settings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._own_upstream = transport is None
        self.client = build_client(settings, transport)
        registry = EngineRegistry(breaker=breaker_config(settings.health))  # random jitter
        for e in settings.engines:
            registry.add(
                e.url,
                role=EngineRole(e.role),
                model=e.model,
                api_key=e.api_key.get_secret_value() if e.api_key else None,
            )
        self.registry = registry
        ctx = PolicyContext(
            seed=settings.seed,
            block_size=settings.block_size or 16,
            perf=load_preset(settings.preset),
            kv_events=settings.kv_events,
            pd=PDSettings(**settings.pd.model_dump()),
        )
        policy = create_policy(settings.policy.name, ctx, settings.policy.options)
        policy = record_decisions(policy, ctx, settings)  # decision_log.enabled: a recorder
        dispatcher = Dispatcher(
            policy,
            pd=ctx.pd,
            perf=ctx.perf,
            queues=RouterQueues(max_total=settings.max_queued, max_per_engine=settings.max_queued),
            sessions=session_affinity(settings.sessions),
        )
        self.dispatcher = dispatcher
        metrics = GatewayMetrics()
        metrics.watch_engines(registry, lambda: dict(dispatcher.in_flight))
        if dispatcher.sessions is not None:
            metrics.watch_sessions(dispatcher.sessions)
        registry.on_transition = lambda e, _old, new: metrics.breaker_transitions.labels(
            e.id, new.value
        ).inc()
        self.metrics = metrics
        self.monitor = EngineMonitor(
            registry,
            self.client,
            interval_s=settings.health.interval_s,
            timeout_s=settings.health.timeout_s,
            models_refresh_s=settings.health.models_refresh_s,
        )
        t = settings.timeouts
        self.upstream: Upstream = (
            HttpxUpstream(transport)
            if transport is not None
            else HttpUpstream(
                Timeouts(t.connect_s, t.read_s, t.write_s, t.pool_s),
                max_connections=settings.max_connections,
            )
        )
        """Engine connections: the proxy forwards on them; stored-response lookups use them."""
        self.keyer = RoutingKeyer(
            settings.block_size or 16, settings.chars_per_token, settings.seed
        )
        self.token_keyer: TokenKeyer | None = (
            TokenKeyer(self.client, registry, seed=settings.vllm_hash_seed)
            if settings.keying == "tokens"
            else None
        )
        self.limiter: RateLimiter | None = build_limiter(
            settings.rate_limit, keyed=bool(settings.api_keys), counter=metrics.rate_limited
        )
        cfg = settings.responses
        self.responses = ResponseStore(
            registry, ttl_s=cfg.ttl_s, max_entries=cfg.max_entries, clock=clock, locate=cfg.locate
        )
        self.pump = QueuePump(registry, dispatcher, clock)
        self.flow: FlowGate | None = build_flow_gate(
            settings.flow_control,
            load_preset(settings.preset),
            lambda model: registry.view(
                dispatcher.in_flight, model=model, queues=dispatcher.queues
            ),
            clock,
            metrics.registry,
            pending_log=registry.pending_log,
        )
        """Flow control, shared by every front end: ``await flow.admit_info(info)`` before
        routing (429/503 :class:`ApiError` when refused); None when ``flow_control`` is off."""
        self.tick: Callable[[], None] | None = self.release
        """What the pump's timer calls (set by the front end before :meth:`start`; None:
        the queue pump alone)."""
        self.bridge = EventBridge(self.client, dispatcher, metrics) if settings.kv_events else None
        if self.bridge is not None and settings.keying != "tokens":
            log.warning(
                "kv_events is on but keying is %r: the engines' block ids will not match the "
                "routing keys; set keying: tokens for an exact cache view",
                settings.keying,
            )
        elif dispatcher.policy.wants_cache_events and self.bridge is None:
            log.info("policy %s models engine caches (kv_events is off)", policy.name)
        self.discovery: Discovery | None = None
        if settings.discovery.kind != "static":  # engines from EndpointSlices or a pool too
            members = RegistryMembership(
                registry, self.monitor, dispatcher, self.bridge.subscriber if self.bridge else None
            )
            self.discovery = create_discovery(settings.discovery, members)
        self.recorder: Recorder | None = None
        self.replica_sync: NatsReplicaSync | None = None
        self.kv_events: KVEventSubscriber | None = None
        self._pump_task: asyncio.Task[None] | None = None

    @property
    def policy_name(self) -> str:
        return self.dispatcher.policy.name

    @property
    def sessions(self) -> SessionAffinity | None:
        """Session bindings (``sessions``), or None when session affinity is off."""
        return self.dispatcher.sessions

    def slo_for(self, name: str | None) -> SloClass:
        """The SLO class a request asked for (header ``x-kvgate-slo-class``), or the default."""
        key = name or self.settings.default_slo_class
        cfg = self.settings.slo_classes.get(key)
        if cfg is None:
            known = ", ".join(sorted(self.settings.slo_classes))
            raise ApiError(
                400, f"unknown SLO class {key!r} (known: {known})", param="x-kvgate-slo-class"
            )
        return SloClass(key, cfg.ttft_s, cfg.tpot_s)

    def engine_headers(self, engine: EngineState) -> list[tuple[bytes, bytes]]:
        """The headers of a request kvgate itself sends to ``engine`` (a stored-response
        lookup)."""
        if engine.api_key:
            return [(b"authorization", b"Bearer " + engine.api_key.encode())]
        return []

    def release(self, engine: str | None = None) -> None:
        """Capacity may have freed (on ``engine``): flow control's next request, then the
        router queues' held requests."""
        if self.flow is not None:
            self.flow.pump()
        self.pump.pump(engine)

    def adopt_block_size(self) -> None:
        """Key prompts on the block size the engines report (``vllm:cache_config_info``)."""
        sizes = sorted(
            {
                e.metrics.block_size
                for e in self.registry.all()
                if e.routable and e.metrics is not None and e.metrics.block_size
            }
        )
        if not sizes:
            return
        size = sizes[0] if len(sizes) == 1 else max(sizes)
        if len(sizes) > 1:
            log.warning("engines report different KV block sizes %s; keying on %d", sizes, size)
        if size != self.keyer.block_size:
            log.info("keying prompts on the engines' block size", extra={"block_size": size})
            self.keyer.set_block_size(size)

    async def start(self) -> None:
        """Start recording and replica sync, probe the engines, start the pump, KV events,
        the health monitor and discovery. Ready when it returns."""
        settings = self.settings
        self.recorder = build_recorder(settings, self.metrics)
        sync = self.replica_sync = start_replica_sync(settings, self.registry, self.dispatcher)
        if sync is not None:  # a response stored behind one replica, found by all
            sync.share_table("response", self.responses.table)
            self.responses.on_bind = lambda key, engine, ttl_s: sync.publish_binding(
                "response", key, engine, ttl_s
            )
        await self.monitor.check_all()
        self._pump_task = asyncio.create_task(
            self.pump.run(PUMP_INTERVAL_S, self.tick), name="kvgate-queue-pump"
        )
        if settings.block_size is None:
            self.adopt_block_size()
        bridge = self.bridge
        if bridge is not None:
            self.kv_events = bridge.subscriber
            for engine in self.registry.all():
                if engine.routable:
                    await bridge.attach(engine)
            # Ready only once the engines' buffered events are replayed (a restarted replica
            # then routes on the engines' cache state at once), or after the replay timeout.
            await bridge.subscriber.caught_up(timeout=2 * bridge.subscriber.replay_timeout_s)

        def on_change(engine: EngineState, healthy: bool) -> None:
            if healthy and settings.block_size is None:
                self.adopt_block_size()
            if bridge is not None:
                bridge.on_health(engine, healthy)

        self.monitor.on_change = on_change
        self.monitor.start()
        if self.discovery is not None:
            await self.discovery.start(wait_s=settings.discovery.timeout_s)
        log.info("kvgate ready", extra={"policy": self.policy_name, "engines": len(self.registry)})

    async def stop(self) -> None:
        """Stop everything :meth:`start` started; the recorder is flushed last."""
        if self.discovery is not None:
            await self.discovery.stop()
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump_task
            self._pump_task = None
        await self.monitor.stop()
        if self.replica_sync is not None:
            await self.replica_sync.stop()
        if self.bridge is not None:
            await self.bridge.aclose()
        await self.client.aclose()
        if self._own_upstream:
            await self.upstream.aclose()
        if self.recorder is not None:  # after the last request: flush every record
            await asyncio.to_thread(self.recorder.close)
