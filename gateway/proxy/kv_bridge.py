"""Connect engines' KV events to the dispatcher (``kv_events: true``).

Each engine's publishers are found with ``GET /kv_event_sources`` when it
first turns healthy; their events become ``Dispatcher.cache_event`` (stored and
removed block ids) and ``Dispatcher.cache_reset`` (cleared cache, lost events,
or an engine that went down — policies then forget what it cached and model it
again until events resume). An engine removed while its publishers were being
looked up stays unsubscribed; removed and added again, it subscribes again.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import httpx

from gateway.cluster.kv_events import CacheDelta, KVEventSubscriber, resolve_sources
from gateway.cluster.registry import EngineState
from gateway.observability import GatewayMetrics
from gateway.policies.dispatcher import Dispatcher

log = logging.getLogger("kvgate.kv_events")


class EventBridge:
    """Subscribes to engines' KV events and feeds the dispatcher."""

    def __init__(
        self, client: httpx.AsyncClient, dispatcher: Dispatcher, metrics: GatewayMetrics
    ) -> None:
        self.client = client
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.subscriber = KVEventSubscriber(self._on_delta)
        self._pending: dict[asyncio.Task[bool], EngineState] = {}

    def _on_delta(self, engine: str, delta: CacheDelta) -> None:
        if not delta.lost:  # a lost-events reset is no batch
            self.metrics.kv_event_batches.labels(engine).inc()
        if delta.cleared:
            self.metrics.kv_event_resets.labels(engine).inc()
            self.dispatcher.cache_reset(engine)
        if delta.stored or delta.removed:
            self.dispatcher.cache_event(engine, delta.stored, delta.removed)

    async def attach(self, engine: EngineState) -> bool:
        """Subscribe to ``engine``'s publishers; False when it publishes none."""
        if self.subscriber.subscribed(engine.id):
            return True
        headers = {"authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
        try:
            resp = await self.client.get(
                engine.url + "/kv_event_sources", headers=headers, timeout=5.0
            )
            config = resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            config = {}
        if engine.retired:  # removed while we asked: stay unsubscribed
            return False
        host = urlsplit(engine.url).hostname or "127.0.0.1"
        sources = resolve_sources(engine.id, host, config) if isinstance(config, dict) else []
        if not sources:
            log.warning(
                "engine %s publishes no KV events (start vLLM with --kv-events-config); "
                "its cache state stays estimated",
                engine.id,
            )
            return False
        self.subscriber.start(sources)
        return True

    def on_health(self, engine: EngineState, healthy: bool) -> None:
        """Monitor callback: attach newly healthy engines; forget what a dead one cached."""
        if healthy and not self.subscriber.subscribed(engine.id):
            if any(e is engine for e in self._pending.values()):
                return  # an attach is already on its way
            task = asyncio.ensure_future(self.attach(engine))
            self._pending[task] = engine
            task.add_done_callback(self._attached)
        elif not healthy:
            self.dispatcher.cache_reset(engine.id)

    def _attached(self, task: asyncio.Task[bool]) -> None:
        engine = self._pending.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            name = engine.id if engine is not None else "?"
            log.error("KV event attach of %s failed: %r", name, task.exception())

    def detach(self, engine_id: str) -> None:
        for task, engine in list(self._pending.items()):
            if engine.id == engine_id:
                task.cancel()
        self.subscriber.stop_engine(engine_id)

    async def aclose(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await self.subscriber.aclose()
