"""``create_app(settings)``: build the gateway; everything is created in the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gateway.cluster.breaker import breaker_config
from gateway.cluster.discovery import KubeDiscovery, RegistryMembership
from gateway.cluster.monitor import EngineMonitor
from gateway.cluster.registry import EngineRegistry, EngineState
from gateway.cluster.replica_sync import NatsReplicaSync, PeerLoad, default_replica_id
from gateway.config import Settings
from gateway.core.errors import ConfigError
from gateway.core.types import EngineRole
from gateway.observability import GatewayMetrics
from gateway.perfmodel.presets import load_preset
from gateway.policies.base import PolicyContext
from gateway.policies.dispatcher import Dispatcher, PDSettings
from gateway.policies.registry import create_policy
from gateway.policies.router_queues import RouterQueues
from gateway.proxy import decision_log, routes_admin, routes_openai
from gateway.proxy.decision_log import record_decisions
from gateway.proxy.deps import GatewayState
from gateway.proxy.errors import install_handlers
from gateway.proxy.fastpath import OpenAIFastPath
from gateway.proxy.forwarder import Forwarder
from gateway.proxy.kv_bridge import EventBridge
from gateway.proxy.overload import InFlightCap
from gateway.proxy.ratelimit import build_limiter
from gateway.proxy.recorder import Recorder
from gateway.proxy.routing_key import RoutingKeyer
from gateway.proxy.token_keys import TokenKeyer
from gateway.proxy.upstream import HttpUpstream, HttpxUpstream, Timeouts, Upstream

log = logging.getLogger("kvgate")


def build_client(
    settings: Settings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """The one shared upstream client: explicit timeouts (never httpx's 5 s default)."""
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


def adopt_block_size(state: GatewayState) -> None:
    """Key prompts on the block size the engines report (``vllm:cache_config_info``)."""
    sizes = sorted(
        {
            e.metrics.block_size
            for e in state.registry.all()
            if e.routable and e.metrics is not None and e.metrics.block_size
        }
    )
    if not sizes:
        return
    size = sizes[0] if len(sizes) == 1 else max(sizes)
    if len(sizes) > 1:
        log.warning("engines report different KV block sizes %s; keying on %d", sizes, size)
    if size != state.keyer.block_size:
        log.info("keying prompts on the engines' block size", extra={"block_size": size})
        state.keyer.set_block_size(size)


def start_recorder(settings: Settings, metrics: GatewayMetrics) -> Recorder | None:
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
    sync.start()
    return sync


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """``GET /openapi.json``: FastAPI's schema, less the 422s it documents for parameter
    errors (kvgate answers those 400, OpenAI-shaped)."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The gateway app. ``transport`` replaces the network in tests."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = build_client(settings, transport)
        registry = EngineRegistry(breaker=breaker_config(settings.health))  # random jitter
        for e in settings.engines:
            registry.add(
                e.url,
                role=EngineRole(e.role),
                model=e.model,
                api_key=e.api_key.get_secret_value() if e.api_key else None,
            )
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
        )
        metrics = GatewayMetrics()
        metrics.watch_engines(registry, lambda: dict(dispatcher.in_flight))
        registry.on_transition = lambda e, _old, new: metrics.breaker_transitions.labels(
            e.id, new.value
        ).inc()
        monitor = EngineMonitor(
            registry,
            client,
            interval_s=settings.health.interval_s,
            timeout_s=settings.health.timeout_s,
        )
        t = settings.timeouts
        upstream: Upstream = (
            HttpxUpstream(transport)
            if transport is not None
            else HttpUpstream(
                Timeouts(t.connect_s, t.read_s, t.write_s, t.pool_s),
                max_connections=settings.max_connections,
            )
        )
        forwarder = Forwarder(settings, upstream, registry, dispatcher, metrics)
        forwarder.recorder = start_recorder(settings, metrics)
        app.state.gateway = GatewayState(
            settings=settings,
            client=client,
            registry=registry,
            dispatcher=dispatcher,
            metrics=metrics,
            monitor=monitor,
            forwarder=forwarder,
            keyer=RoutingKeyer(settings.block_size or 16, settings.chars_per_token, settings.seed),
        )
        state = app.state.gateway
        state.limiter = build_limiter(
            settings.rate_limit, keyed=bool(settings.api_keys), counter=metrics.rate_limited
        )
        if settings.keying == "tokens":
            state.token_keyer = TokenKeyer(client, registry, seed=settings.vllm_hash_seed)
        bridge = EventBridge(client, dispatcher, metrics) if settings.kv_events else None
        if bridge is not None and settings.keying != "tokens":
            log.warning(
                "kv_events is on but keying is %r: the engines' block ids will not match the "
                "routing keys; set keying: tokens for an exact cache view",
                settings.keying,
            )
        elif dispatcher.policy.wants_cache_events and bridge is None:
            log.info("policy %s models engine caches (kv_events is off)", policy.name)
        discovery = None
        if settings.discovery.kind == "kubernetes":  # engines from EndpointSlices too
            members = RegistryMembership(
                registry, monitor, dispatcher, bridge.subscriber if bridge else None
            )
            discovery = KubeDiscovery(settings.discovery, members)
        replica_sync = start_replica_sync(settings, registry, dispatcher)
        app.state.replica_sync = replica_sync  # tests and admin read it here
        await monitor.check_all()
        pump = asyncio.create_task(forwarder.run_pump(0.05), name="kvgate-queue-pump")
        if settings.block_size is None:
            adopt_block_size(state)
        if bridge is not None:
            state.kv_events = bridge.subscriber
            for engine in registry.all():
                if engine.routable:
                    await bridge.attach(engine)
            # Ready only once the engines' buffered events are replayed (a restarted replica
            # then routes on the engines' cache state at once), or after the replay timeout.
            await bridge.subscriber.caught_up(timeout=2 * bridge.subscriber.replay_timeout_s)

        def on_change(engine: EngineState, healthy: bool) -> None:
            if healthy and settings.block_size is None:
                adopt_block_size(state)
            if bridge is not None:
                bridge.on_health(engine, healthy)

        monitor.on_change = on_change
        monitor.start()
        if discovery is not None:
            await discovery.start(wait_s=settings.discovery.timeout_s)
        log.info("kvgate ready", extra={"policy": policy.name, "engines": len(registry)})
        try:
            yield
        finally:
            if discovery is not None:
                await discovery.stop()
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            await monitor.stop()
            if replica_sync is not None:
                await replica_sync.stop()
            if bridge is not None:
                await bridge.aclose()
            await client.aclose()
            if transport is None:
                await upstream.aclose()
            if forwarder.recorder is not None:  # after the last request: flush every record
                await asyncio.to_thread(forwarder.recorder.close)

    app = FastAPI(
        title="kvgate",
        version="0.1.0",
        description="OpenAI-compatible KV-cache-aware routing gateway for vLLM engines",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    install_handlers(app)
    app.add_middleware(OpenAIFastPath)
    if settings.max_in_flight is not None:  # outermost: counts whole responses, streams too
        app.add_middleware(InFlightCap, limit=settings.max_in_flight)
    app.include_router(routes_openai.router)
    app.include_router(routes_admin.router)
    app.include_router(routes_admin.admin)
    app.include_router(decision_log.admin)
    return app
