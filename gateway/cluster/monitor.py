"""Active health checks and metric scraping of every engine, on an interval.

Each round, for every engine at once: ``GET /health`` (the liveness probe),
``GET /v1/models`` until the engine's models are known, and ``GET /metrics``
(parsed into :class:`EngineMetrics`). A failing engine is taken out of
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
        on_change: StateListener | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
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

    async def _run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # pragma: no cover - never let the loop die
                log.exception("engine monitor round failed")
            self._wake.clear()
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
            if not engine.models:
                engine.models = await self._discover_models(engine, headers)
            metrics = await self.client.get(
                f"{engine.url}/metrics", headers=headers, timeout=self.timeout_s
            )
            if metrics.status_code == 200:
                try:
                    engine.metrics = parse_vllm_metrics(metrics.text)
                    engine.last_scrape = self.clock()
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

    async def _discover_models(
        self, engine: EngineState, headers: dict[str, str]
    ) -> tuple[str, ...]:
        resp = await self.client.get(
            f"{engine.url}/v1/models", headers=headers, timeout=self.timeout_s
        )
        if resp.status_code != 200:
            raise _ProbeError(f"/v1/models answered {resp.status_code}")
        try:
            data = resp.json()["data"]
            models = tuple(str(m["id"]) for m in data)
        except (ValueError, KeyError, TypeError):
            raise _ProbeError("/v1/models is not an OpenAI model list") from None
        if not models:
            raise _ProbeError("/v1/models lists no model")
        return models

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
