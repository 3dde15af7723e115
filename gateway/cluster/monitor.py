"""Active health checks and metric scraping of every engine, on an interval.

Each round, for every engine at once: ``GET /health`` (the liveness probe),
``GET /v1/models`` when due, and ``GET /metrics`` (parsed into :class:`EngineMetrics`).
The model list (base models and LoRA adapters, :mod:`gateway.cluster.model_list`)
is read at the first round, then every ``models_refresh_s`` and at the next round
after :meth:`EngineMonitor.refresh_models_soon` (the engine answered 404 for a
model it listed): adapters loaded at runtime become routable, unloaded ones stop
being routed to. Only the first discovery is a health condition: a failing
re-read keeps the models known and the engine in routing. A failing engine is taken out of
routing after ``failure_threshold`` failed rounds (or at once when the
forwarder saw a refused connection) and is probed back in: the same rounds
keep running against it and, once its breaker's cooldown is over (half-open),
``recovery_threshold`` good ones bring it back (see :mod:`gateway.cluster.breaker`).
A failing or unparsable ``/metrics`` is logged and leaves health alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx

from gateway.cluster.model_list import ModelList, ModelListError, parse_model_list
from gateway.cluster.registry import EngineRegistry, EngineState
from gateway.cluster.scraper import MetricsParseError, parse_vllm_metrics

log = logging.getLogger("kvgate.cluster")

StateListener = Callable[[EngineState, bool], None]


class EngineMonitor:
    """Probes and scrapes the registry's engines until stopped."""

    def __init__(
        self,
        registry: EngineRegistry,
        client: httpx.AsyncClient,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        models_refresh_s: float = 5.0,
        on_change: StateListener | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.models_refresh_s = models_refresh_s
        self.poke_gap_s = 0.25
        """:meth:`refresh_models_soon` starts a round at once only when the engine's models
        were read longer ago than this; otherwise the next regular round reads them."""
        self.on_change = on_change
        self.clock = clock
        self.rounds = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvgate-engine-monitor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def poke(self) -> None:
        """Run the next round now (after a membership change or a failure)."""
        self._wake.set()

    def refresh_models_soon(self, engine_id: str) -> None:
        """Re-read the engine's ``/v1/models`` at the next round (call when it answered 404
        for a model); starts that round now unless its models were read a moment ago."""
        engine = self.registry.get(engine_id)
        if engine is None or engine.retired or engine.models_stale:
            return
        engine.models_stale = True
        last = engine.models_checked
        if last is None or self.clock() - last >= self.poke_gap_s:
            self.poke()

    async def _run(self) -> None:
        while True:
            self._wake.clear()  # a poke during the round runs another one right after
            try:
                await self.check_all()
            except Exception:  # pragma: no cover - never let the loop die
                log.exception("engine monitor round failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()

    async def check_all(self) -> None:
        """One round over every engine, concurrently."""
        engines = [e for e in self.registry.all() if not e.retired]
        if engines:
            await asyncio.gather(*(self.check(e) for e in engines))
        self.rounds += 1

    async def check(self, engine: EngineState) -> bool:
        """Probe one engine; True when it is healthy."""
        headers = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
        try:
            health = await self.client.get(
                f"{engine.url}/health", headers=headers, timeout=self.timeout_s
            )
            if health.status_code != 200:
                raise _ProbeError(f"/health answered {health.status_code}")
            if self._models_due(engine):
                await self._refresh_models(engine, headers)
            metrics = await self.client.get(
                f"{engine.url}/metrics", headers=headers, timeout=self.timeout_s
            )
            if metrics.status_code == 200:
                try:
                    engine.observe(parse_vllm_metrics(metrics.text), self.registry.clock())
                except MetricsParseError as exc:
                    log.warning("engine %s: unusable /metrics: %s", engine.id, exc)
            else:
                log.warning("engine %s: /metrics answered %s", engine.id, metrics.status_code)
        except (httpx.HTTPError, _ProbeError) as exc:
            reason = _describe(exc)
            if self.registry.mark_failure(engine.id, reason, self.clock(), probe=True):
                log.warning("engine %s taken out of routing: %s", engine.id, reason)
                self._notify(engine, False)
            return False
        if self.registry.mark_success(engine.id, self.clock(), probe=True):
            log.info("engine %s is healthy (models: %s)", engine.id, ", ".join(engine.models))
            self._notify(engine, True)
        return True

    def _models_due(self, engine: EngineState) -> bool:
        last = engine.models_checked
        return (
            not engine.models
            or engine.models_stale
            or last is None
            or self.clock() - last >= self.models_refresh_s
        )

    async def _refresh_models(self, engine: EngineState, headers: dict[str, str]) -> None:
        """Read the engine's models; raises :class:`_ProbeError` only while none is known."""
        engine.models_stale = False
        engine.models_checked = self.clock()
        discovery = not engine.models
        try:
            listing = await self._read_models(engine, headers)
        except (httpx.HTTPError, _ProbeError) as exc:
            engine.model_refresh_failures += 1
            if discovery:
                raise
            log.warning("engine %s: /v1/models re-read failed: %s", engine.id, _describe(exc))
            return
        engine.model_refreshes += 1
        self._apply_models(engine, listing)

    async def _read_models(self, engine: EngineState, headers: dict[str, str]) -> ModelList:
        resp = await self.client.get(
            f"{engine.url}/v1/models", headers=headers, timeout=self.timeout_s
        )
        if resp.status_code != 200:
            raise _ProbeError(f"/v1/models answered {resp.status_code}")
        try:
            return parse_model_list(resp.json())
        except ValueError as exc:  # ModelListError, or a body that is not JSON
            if isinstance(exc, ModelListError):
                raise _ProbeError(str(exc)) from None
            raise _ProbeError("/v1/models is not an OpenAI model list") from None

    @staticmethod
    def _apply_models(engine: EngineState, listing: ModelList) -> None:
        models = listing.models
        configured = engine.configured_model
        if configured:  # the operator's name stays served, first
            models = (configured, *(m for m in models if m != configured))
        if listing.truncated:
            log.warning("engine %s: /v1/models lists more models than kvgate reads", engine.id)
        if engine.models and models != engine.models:
            added = [m for m in models if m not in engine.models]
            removed = [m for m in engine.models if m not in models]
            log.info(
                "engine %s models changed: +%s -%s",
                engine.id,
                ",".join(added) or "none",
                ",".join(removed) or "none",
                extra={"engine": engine.id, "added": added, "removed": removed},
            )
        engine.models = models
        engine.lora = listing.lora

    def _notify(self, engine: EngineState, healthy: bool) -> None:
        if self.on_change is not None:
            self.on_change(engine, healthy)


class _ProbeError(Exception):
    pass


def _describe(exc: BaseException) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"timeout ({type(exc).__name__})"
    if isinstance(exc, httpx.ConnectError):
        return "connection refused or unreachable"
    return str(exc) or type(exc).__name__
