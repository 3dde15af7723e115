"""Replica load sync: peer snapshots (unit), and replicas sharing load over a real NATS server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from gateway.cluster.registry import EngineRegistry
from gateway.cluster.replica_sync import NatsReplicaSync, PeerLoad, _Message
from gateway.core.errors import ConfigError
from tests.replicas.services import Service, start_nats, until

E1, E2 = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


def msg(replica: str, seq: int, loads: dict[str, tuple[int, int]], bye: bool = False) -> bytes:
    return msgspec.msgpack.encode(_Message(replica, seq, loads, bye))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_peer_snapshots_are_summed_latest_first_and_expire() -> None:
    clock = Clock()
    peers = PeerLoad("me", ttl_s=3.0, clock=clock)
    peers.apply(msg("a", 1, {E1: (2, 100)}))
    peers.apply(msg("b", 1, {E1: (1, 50), E2: (4, 0)}))
    assert peers.of(E1) == (3, 150) and peers.of(E2) == (4, 0)
    peers.apply(msg("a", 3, {E1: (5, 0)}))
    peers.apply(msg("a", 2, {E1: (9, 9)}))  # older than what we have: ignored
    assert peers.of(E1) == (6, 50)
    peers.apply(msg("me", 7, {E1: (100, 100)}))  # our own message comes back: ignored
    assert peers.of(E1) == (6, 50)
    peers.apply(b"\x93not a message")
    assert peers.rejected == 1
    clock.t += 2.0
    peers.apply(msg("b", 2, {E2: (1, 0)}))
    clock.t += 1.5  # a: silent 3.5 s, past the ttl; b: 1.5 s
    assert peers.peers == ["b"] and peers.of(E1) == (0, 0) and peers.of(E2) == (1, 0)
    peers.apply(msg("b", 3, {}, bye=True))  # a replica that shuts down leaves at once
    assert peers.peers == [] and peers.of(E2) == (0, 0)


def test_the_view_adds_the_peers_load_to_ours() -> None:
    registry = EngineRegistry()
    for url in (E1, E2):
        registry.add(url, model="m")
    registry.add_pending(E1, "r1", 300)
    peers = PeerLoad("me")
    registry.peers = peers
    peers.apply(msg("a", 1, {E1: (3, 700), E2: (1, 10)}))
    view = registry.view({E1: 2})
    e1, e2 = view.get(E1), view.get(E2)
    assert e1 is not None and e2 is not None
    assert (e1.in_flight, e1.pending_prefill_tokens) == (5, 1000)
    assert (e2.in_flight, e2.pending_prefill_tokens) == (1, 10)


def test_bad_sync_settings_are_refused() -> None:
    from gateway.config import load_settings

    with pytest.raises(ConfigError, match="nats_url"):
        load_settings(replica_sync={"nats_url": "http://nats:4222"})
    with pytest.raises(ConfigError, match="ttl_s"):
        load_settings(replica_sync={"nats_url": "nats://n:4222", "ttl_s": 1, "heartbeat_s": 1})


async def test_replicas_see_each_others_load_over_nats(nats: Service) -> None:
    loads = {"a": {E1: (0, 0)}, "b": {E1: (0, 0)}}
    syncs = {
        name: NatsReplicaSync(nats.url, lambda n=name: loads[n], PeerLoad(name), interval_s=0.01)
        for name in loads
    }
    for s in syncs.values():
        s.start()
    try:
        await until(lambda: all(s.connected for s in syncs.values()))
        loads["a"] = {E1: (4, 1200)}
        # a publishes every 10 ms: b sees it once its subscription is registered (no sleep
        # needed for that), within until()'s timeout
        await until(lambda: syncs["b"].peers.of(E1) == (4, 1200))
        loads["b"] = {E1: (1, 0), E2: (2, 64)}
        await until(lambda: syncs["a"].peers.of(E2) == (2, 64))
        assert syncs["a"].peers.of(E1) == (1, 0)
        await syncs["a"].stop()  # says goodbye: b forgets a's load without waiting the ttl
        await until(lambda: syncs["b"].peers.peers == [], timeout=1.0)
        assert syncs["b"].peers.of(E1) == (0, 0)
    finally:
        for s in syncs.values():
            await s.stop()


async def test_a_nats_server_that_comes_late_is_joined(tmp_path: Path) -> None:
    from gateway.cli.demo import free_port

    port = free_port()
    sync = NatsReplicaSync(f"nats://127.0.0.1:{port}", lambda: {E1: (1, 0)}, PeerLoad("a"))
    sync.start()
    svc = None
    try:
        await until(lambda: sync.connect_failures >= 1, timeout=10)  # it tried, and retries
        assert not sync.connected
        svc = await asyncio.to_thread(start_nats, tmp_path, port)
        await until(lambda: sync.connected and sync.published > 0, timeout=10)
    finally:
        await sync.stop()
        if svc is not None:
            svc.stop()
