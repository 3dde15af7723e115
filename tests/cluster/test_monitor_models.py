"""The monitor re-reads engines' /v1/models (periodically and after a 404), keeps the engine
in routing when a re-read fails, and the registry's view carries adapter residency."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fake_kube import wait_until

from gateway.cluster.monitor import EngineMonitor
from gateway.cluster.registry import MAX_LORA_REQUESTS_TRACKED, EngineRegistry, Health, LoraAdapter

URL = "http://e:1"
BASE = "llama"
METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0"}} 1.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{running}",\
waiting_lora_adapters=""}} 2.0
vllm:lora_requests_info{{max_lora="2",running_lora_adapters="stale",waiting_lora_adapters=""}} 1.0
"""


@dataclass
class Engine:
    """A vLLM-like engine whose adapters can be loaded and unloaded, and /v1/models broken."""

    adapters: dict[str, str] = field(default_factory=dict)
    models_status: int = 200
    running: str = ""
    models_reads: int = 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            self.models_reads += 1
            if self.models_status != 200:
                return httpx.Response(self.models_status, text="nope")
            cards: list[dict[str, Any]] = [{"id": BASE, "root": "/models/llama", "parent": None}]
            cards += [{"id": n, "root": p, "parent": BASE} for n, p in self.adapters.items()]
            return httpx.Response(200, json={"object": "list", "data": cards})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS.format(running=self.running))
        return httpx.Response(404)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def monitored(
    engine: Engine, *, model: str | None = None, refresh_s: float = 5.0
) -> AsyncIterator[tuple[EngineRegistry, EngineMonitor, Clock]]:
    clock = Clock()
    registry = EngineRegistry(clock=clock)
    registry.add(URL, model=model)
    transport = httpx.MockTransport(engine.handle)
    async with httpx.AsyncClient(transport=transport) as client:
        monitor = EngineMonitor(
            registry, client, interval_s=60.0, models_refresh_s=refresh_s, clock=clock
        )
        yield registry, monitor, clock


async def test_models_and_adapters_are_read_and_re_read_periodically() -> None:
    engine = Engine(adapters={"sql": "/a/sql"})
    async with monitored(engine) as (registry, monitor, clock):
        await monitor.check_all()
        state = registry.get(URL)
        assert state is not None
        assert state.models == (BASE, "sql")
        assert state.lora == {"sql": LoraAdapter("sql", BASE, "/a/sql")}
        assert registry.lora_adapter("sql") == LoraAdapter("sql", BASE, "/a/sql")
        assert registry.lora_adapter(BASE) is None
        engine.adapters["chat"] = "/a/chat"  # /v1/load_lora_adapter at runtime
        clock.now += 4.9
        await monitor.check_all()
        assert "chat" not in state.models  # not due yet
        clock.now += 0.1
        await monitor.check_all()
        assert state.models == (BASE, "sql", "chat")
        assert registry.view({}, model="chat").ids == (URL,)
        del engine.adapters["sql"]  # /v1/unload_lora_adapter
        clock.now += 5.0
        await monitor.check_all()
        assert state.models == (BASE, "chat")
        assert registry.lora_adapter("sql") is None
        assert registry.view({}, model="sql").ids == ()
        assert (state.model_refreshes, engine.models_reads) == (3, 3)


async def test_a_failing_re_read_keeps_the_engine_and_its_models() -> None:
    engine = Engine(adapters={"sql": "/a/sql"})
    async with monitored(engine) as (registry, monitor, clock):
        await monitor.check_all()
        state = registry.get(URL)
        assert state is not None and state.health is Health.HEALTHY
        engine.models_status = 500
        for _ in range(4):
            clock.now += 5.0
            await monitor.check_all()
        assert state.health is Health.HEALTHY and state.routable
        assert state.models == (BASE, "sql")
        assert state.model_refresh_failures == 4


async def test_a_failing_first_discovery_is_a_health_condition() -> None:
    engine = Engine(models_status=500)
    async with monitored(engine) as (registry, monitor, clock):
        for _ in range(2):
            await monitor.check_all()
            clock.now += 1.0
        state = registry.get(URL)
        assert state is not None
        assert state.health is Health.UNHEALTHY and not state.routable
        assert "/v1/models answered 500" in (state.last_error or "")


async def test_a_configured_model_stays_and_discovered_adapters_join_it() -> None:
    engine = Engine(adapters={"sql": "/a/sql"})
    async with monitored(engine, model="served-name") as (registry, monitor, _clock):
        await monitor.check_all()
        state = registry.get(URL)
        assert state is not None
        assert state.models == ("served-name", BASE, "sql")
        engine.models_status = 503
        state.models_stale = True
        await monitor.check_all()
        assert state.models == ("served-name", BASE, "sql") and state.routable


async def test_refresh_models_soon_re_reads_before_the_interval() -> None:
    engine = Engine()
    async with monitored(engine, refresh_s=3600.0) as (registry, monitor, clock):
        await monitor.check_all()
        state = registry.get(URL)
        assert state is not None and state.models == (BASE,)
        engine.adapters["sql"] = "/a/sql"
        clock.now += 1.0
        monitor.start()  # its first round reads nothing new (not due), then waits 60 s
        await wait_until(lambda: monitor.rounds >= 2, what="the first round")
        assert "sql" not in state.models
        monitor.refresh_models_soon(URL)  # the engine answered 404 for a model
        await wait_until(lambda: "sql" in state.models, what="the re-read after a 404")
        assert not state.models_stale
        monitor.refresh_models_soon("http://unknown:1")  # no such engine: ignored
        await monitor.stop()


async def test_refresh_soon_right_after_a_read_waits_for_the_next_round() -> None:
    engine = Engine()
    async with monitored(engine, refresh_s=3600.0) as (registry, monitor, _clock):
        await monitor.check_all()
        state = registry.get(URL)
        assert state is not None
        monitor.refresh_models_soon(URL)  # read 0 s ago: no extra round now
        assert state.models_stale and not monitor._wake.is_set()
        engine.adapters["sql"] = "/a/sql"
        await monitor.check_all()  # the next regular round
        assert state.models == (BASE, "sql") and not state.models_stale


async def test_view_carries_residency_scraped_and_in_flight() -> None:
    engine = Engine(adapters={"sql": "/a/sql", "chat": "/a/chat"}, running="sql")
    async with monitored(engine) as (registry, monitor, _clock):
        await monitor.check_all()
        (view,) = registry.view({}).engines
        assert (view.lora_resident, view.max_lora) == (frozenset({"sql"}), 2)
        registry.begin_attempt(URL, "r1", lora="chat")
        registry.begin_attempt(URL, "r2")
        (view,) = registry.view({}).engines
        assert view.lora_resident == frozenset({"sql", "chat"})
        registry.end_attempt(URL, "r1")
        registry.end_attempt(URL, "r1")  # idempotent
        (view,) = registry.view({}).engines
        assert view.lora_resident == frozenset({"sql"})


def test_in_flight_adapter_accounting_is_bounded() -> None:
    registry = EngineRegistry()
    state = registry.add(URL, model=BASE)
    for i in range(MAX_LORA_REQUESTS_TRACKED + 3):
        registry.begin_attempt(URL, f"r{i}", lora="sql")
    assert len(state.lora_by_request) == MAX_LORA_REQUESTS_TRACKED
    (view,) = registry.view({}).engines
    assert view.lora_resident == frozenset({"sql"}) and view.max_lora == 0
