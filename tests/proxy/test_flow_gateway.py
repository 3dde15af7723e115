"""Flow control in the gateway against fake engines: the priority sent to vLLM
(``engine_priority``), bad priorities, and saturated engines (wait, time out, refuse)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fake_engines import FakeCluster, FakeEngine

from gateway.config import load_settings
from gateway.proxy.app import create_app
from tests.promtext import sample_sum

A = "http://a:1"
BODY = {"model": "m", "prompt": "hello " * 50, "max_tokens": 2, "priority": 3}


@asynccontextmanager
async def gateway(engine: FakeEngine, **flow: Any) -> AsyncIterator[httpx.AsyncClient]:
    cfg = load_settings(engines=[{"url": engine.url}], log_requests=False, flow_control=flow)
    app = create_app(cfg, transport=FakeCluster(engine).transport())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client


@pytest.mark.parametrize(("mode", "sent"), [("passthrough", 3), ("set", 7), ("strip", None)])
async def test_the_priority_sent_to_the_engine(mode: str, sent: int | None) -> None:
    a = FakeEngine(A)
    async with gateway(a, engine_priority=mode) as gw:
        r = await gw.post("/v1/completions", json=BODY, headers={"x-kvgate-priority": "7"})
    assert r.status_code == 200
    assert json.loads(a.raw[0]).get("priority") == sent


async def test_a_priority_that_is_no_integer_is_400_and_not_forwarded() -> None:
    a = FakeEngine(A)
    async with gateway(a) as gw:
        bad = await gw.post("/v1/completions", json={**BODY, "priority": "high"})
        header = await gw.post("/v1/completions", json=BODY, headers={"x-kvgate-priority": "x"})
    assert bad.status_code == header.status_code == 400
    assert bad.json()["error"]["param"] == "priority"
    assert a.raw == []


async def test_saturated_engines_hold_requests_then_503_or_429_with_retry_after() -> None:
    a = FakeEngine(A, waiting=50)  # scraped: 50 waiting >= max_waiting
    async with gateway(a, queue_timeout_s=0.2, max_queued=1) as gw:
        first, second = await asyncio.gather(
            gw.post("/v1/completions", json=BODY), gw.post("/v1/completions", json=BODY)
        )
    statuses = sorted([first.status_code, second.status_code])
    assert statuses == [429, 503]
    for r in (first, second):
        assert r.headers["retry-after"].isdigit()
        assert r.json()["error"]["type"] in ("rate_limit_error", "service_unavailable")
    assert a.raw == []  # neither reached the engine


async def test_flow_control_off_admits_even_saturated_engines() -> None:
    a = FakeEngine(A, waiting=50)
    async with gateway(a, enabled=False) as gw:
        r = await gw.post("/v1/completions", json=BODY)
    assert r.status_code == 200


async def test_engines_with_room_never_hold_a_request_at_the_gate() -> None:
    """Flow control has no effect below saturation: 200 distinct prompts, 10 at a time, on
    an engine that answers at once are all admitted directly (each one's pending prefill is
    cleared when it ends, so the prefill queued ahead never nears ``max_ttft_s``)."""
    a = FakeEngine(A)
    bodies = [{**BODY, "prompt": f"{i} " + "hello " * 50} for i in range(200)]
    async with gateway(a, max_ttft_s=0.1) as gw:
        for k in range(0, 200, 10):
            posts = (gw.post("/v1/completions", json=b) for b in bodies[k : k + 10])
            got = await asyncio.gather(*posts)
            assert [r.status_code for r in got] == [200] * 10
        page = (await gw.get("/metrics")).text
    assert sample_sum(page, "kvgate_flow_admitted_total", path="direct") == 200
    assert sample_sum(page, "kvgate_flow_admitted_total", path="queued") == 0
