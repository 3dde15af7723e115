"""A response stored behind one gateway replica is followed up through another: the
response id -> engine binding travels over replica sync (a real NATS server)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
from fake_api_engines import FakeApiEngine
from fake_engines import FakeCluster

from gateway.config import load_settings
from gateway.proxy.app import create_app
from tests.replicas.services import Service, until

A, B = "http://a:1", "http://b:1"


@asynccontextmanager
async def replica(
    cluster: FakeCluster, name: str, nats_url: str
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    cfg = load_settings(
        engines=[{"url": u} for u in cluster.engines],
        policy={"name": "round_robin"},
        log_requests=False,
        replica_sync={"nats_url": nats_url, "replica_id": name},
        responses={"locate": False},  # only replica sync can tell B where the response is
    )
    app = create_app(cfg, transport=cluster.transport())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client, app.state


async def test_a_follow_up_through_another_replica_reaches_the_storing_engine(
    nats: Service,
) -> None:
    cluster = FakeCluster(FakeApiEngine(A), FakeApiEngine(B))
    async with AsyncExitStack() as stack:
        gw_a, state_a = await stack.enter_async_context(replica(cluster, "ra", nats.url))
        gw_b, state_b = await stack.enter_async_context(replica(cluster, "rb", nats.url))
        await until(lambda: state_a.replica_sync.connected and state_b.replica_sync.connected)
        # each has a message from the other: the server has processed the other's
        # subscriptions, sent on its connection before its first publish
        await until(
            lambda: (
                state_a.replica_sync.peers.received > 0 and state_b.replica_sync.peers.received > 0
            )
        )
        first = await gw_a.post("/v1/responses", json={"model": "m", "input": "hello"})
        owner, response_id = first.headers["x-kvgate-engine"], first.json()["id"]
        store_b = state_b.gateway.forwarder.responses
        await until(lambda: store_b.table.get(response_id, store_b.clock()) is not None)
        for turn in range(3):  # B's round robin alone would alternate engines
            r = await gw_b.post(
                "/v1/responses",
                json={"model": "m", "input": f"t{turn}", "previous_response_id": response_id},
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-kvgate-engine"] == owner
