"""GET /admin/decisions: the gateway's decision log, paged, and replayable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fake_engines import FakeCluster, FakeEngine

from gateway.config import load_settings
from gateway.policies.recording import replay
from gateway.policies.recording_codec import decode_call, decode_spec
from gateway.proxy.app import create_app

A, B = "http://a:1", "http://b:1"


@asynccontextmanager
async def gateway(**settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    engines = [FakeEngine(A, delay=0.05), FakeEngine(B, delay=0.05)]
    cfg = load_settings(engines=[{"url": e.url} for e in engines], log_requests=False, **settings)
    app = create_app(cfg, transport=FakeCluster(*engines).transport())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client


async def test_the_log_pages_and_replays_into_a_fresh_policy() -> None:
    async with gateway(decision_log={"enabled": True}, policy={"name": "cache_aware"}) as gw:
        bodies = [{"model": "m", "prompt": f"shared prefix {i % 3} " * 40} for i in range(12)]
        answers = await asyncio.gather(*(gw.post("/v1/completions", json=b) for b in bodies))
        assert [r.status_code for r in answers] == [200] * 12
        first = (await gw.get("/admin/decisions", params={"limit": 5})).json()
        rest = (await gw.get("/admin/decisions", params={"offset": 5, "limit": 10_000})).json()
        bad = await gw.get("/admin/decisions", params={"limit": 0})
    assert bad.status_code == 400 and "error" in bad.json()
    assert first["spec"]["name"] == "cache_aware" and len(first["calls"]) == 5
    assert first["total"] == rest["total"] == 5 + len(rest["calls"])
    assert not rest["truncated"]
    calls = [decode_call(c) for c in first["calls"] + rest["calls"]]
    decides = [c for c in calls if c.method == "decide"]
    assert len(decides) == 12
    # the engine each client got is the engine its recorded decision named
    by_id = {c.args[0].id: c.result.engine for c in decides}
    assert sorted(by_id.values()) == sorted(r.headers["x-kvgate-engine"] for r in answers)
    assert {r.headers["x-request-id"]: r.headers["x-kvgate-engine"] for r in answers} == by_id
    assert replay(calls, decode_spec(first["spec"]).build()) == []


async def test_off_by_default_and_admin_only() -> None:
    async with gateway() as gw:
        off = await gw.get("/admin/decisions")
    assert off.status_code == 404 and "decision_log" in off.json()["error"]["message"]
    async with gateway(decision_log={"enabled": True}, admin_key="k") as gw:
        anonymous = await gw.get("/admin/decisions")
        allowed = await gw.get("/admin/decisions", headers={"authorization": "Bearer k"})
    assert anonymous.status_code == 401 and allowed.status_code == 200
