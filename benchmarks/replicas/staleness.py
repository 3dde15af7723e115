"""How stale are the signals a replica routes on? Prints the replica-sync lag over a real
NATS server and the KV-event lag of an emulated engine (publish -> subscriber).

    .venv/bin/python -m benchmarks.replicas.staleness

Lag of the sync: from one replica's routing (``poke``) to the peer seeing the new load.
Lag of KV events: from the engine publishing a batch (its ``ts``) to the gateway's
subscriber socket receiving it. Scrape staleness is ``health.interval_s`` (1 s) by design.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import zmq
import zmq.asyncio

from benchmarks.common import benchmark_parser
from gateway.cluster.kv_events import resolve_sources
from gateway.cluster.replica_sync import NatsReplicaSync, PeerLoad
from gateway.emulator import EmulatorSettings, create_emulator_app
from gateway.emulator.kv_publisher import KVEventsConfig
from tests.replicas.services import start_nats

N = 50


def summary(name: str, lags: list[float]) -> None:
    lags = sorted(lags)
    p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
    print(
        f"{name}: median {statistics.median(lags) * 1e3:.2f} ms, "
        f"p99 {p99 * 1e3:.2f} ms, n={len(lags)}"
    )


async def sync_lag(url: str) -> list[float]:
    load = {"e": (0, 0)}
    a = NatsReplicaSync(url, lambda: load, PeerLoad("a"))
    b = NatsReplicaSync(url, lambda: {}, PeerLoad("b"))
    a.start()
    b.start()
    while not (a.connected and b.connected):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    lags = []
    for i in range(1, N + 1):
        load = {"e": (i, 0)}
        t0 = time.perf_counter()
        a.poke()
        while b.peers.of("e") != (i, 0):
            await asyncio.sleep(0)
        lags.append(time.perf_counter() - t0)
        await asyncio.sleep(0.01)
    await a.stop()
    await b.stop()
    return lags


async def event_lag() -> list[float]:
    events = KVEventsConfig(endpoint="tcp://127.0.0.1:0")
    app = create_emulator_app(EmulatorSettings(time_scale=0.01, kv_events=events))
    lags: list[float] = []
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://e") as client:
            [src] = resolve_sources(
                "e", "127.0.0.1", (await client.get("/kv_event_sources")).json()
            )
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(src.endpoint)
            await asyncio.sleep(0.3)  # the subscription reaches the publisher
            for i in range(N):
                body = {"prompt": f"{i:05d}" + "y" * 800, "max_tokens": 1}
                task = asyncio.create_task(client.post("/v1/completions", json=body))
                _, _, payload = await sock.recv_multipart()
                lags.append(time.time() - msgspec.msgpack.decode(payload)[0])
                await task
            sock.close(linger=0)
            ctx.term()
    return lags


def main() -> None:
    benchmark_parser(__doc__, "benchmarks.replicas.staleness").parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        nats = start_nats(Path(tmp))
        try:
            summary(
                "replica sync lag (route -> peer sees the load)", asyncio.run(sync_lag(nats.url))
            )
        finally:
            nats.stop()
    summary("KV event lag (engine publishes -> subscriber receives)", asyncio.run(event_lag()))


if __name__ == "__main__":
    main()
