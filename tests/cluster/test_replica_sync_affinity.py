"""Affinity bindings shared between replicas: the message format (unit), and a session
bound on replica A routed by replica B over a real NATS server."""

from __future__ import annotations

import time

import msgspec

from gateway.cluster.replica_sync import AFFINITY_VERSION, NatsReplicaSync, PeerLoad
from gateway.core.types import ClusterView, EngineView, RequestInfo
from gateway.policies import Dispatcher
from gateway.policies.affinity_table import AffinityTable
from gateway.policies.base import PolicyContext
from gateway.policies.registry import create_policy
from gateway.policies.session_affinity import SessionAffinity
from tests.replicas.services import Service, until

E1, E2, E3 = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"
VIEW = ClusterView(tuple(EngineView(e) for e in (E1, E2, E3)))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def affinity(replica: str, bindings: list[list[object]], version: int = AFFINITY_VERSION) -> bytes:
    return msgspec.msgpack.encode([version, replica, bindings])


def sync_for(name: str, url: str = "nats://127.0.0.1:1", **kw: object) -> NatsReplicaSync:
    return NatsReplicaSync(url, dict, PeerLoad(name), **kw)  # type: ignore[arg-type]


def test_peer_bindings_land_in_the_table_of_that_name() -> None:
    clock = Clock()
    sync = sync_for("me", clock=clock)
    sessions = AffinityTable(ttl_s=600, max_entries=10)
    sync.share_table("session", sessions)
    sync.apply_affinity(affinity("a", [["session", "s1", E2, 30.0], ["response", "r1", E1, 9.0]]))
    assert sessions.get("s1", clock.t) == E2 and sync.bindings_applied == 1  # no "response"
    clock.t += 31.0  # the remaining TTL the peer sent, not ours
    assert sessions.get("s1", clock.t) is None
    sync.apply_affinity(affinity("a", [["session", "s2", E1, 10_000.0]]))
    assert sessions.expires("s2") == clock.t + 600  # never longer than our own TTL
    sync.apply_affinity(affinity("me", [["session", "s3", E1, 5.0]]))  # our own echo
    sync.apply_affinity(affinity("a", [["session", "s4", E1, 5.0]], version=2))  # newer format
    sync.apply_affinity(msgspec.msgpack.encode(["replica", 1, {}]))  # a load message
    sync.apply_affinity(b"\xc1junk")
    assert sessions.get("s3", clock.t) is None and sessions.get("s4", clock.t) is None
    assert sync.bindings_rejected == 3


def test_queued_bindings_are_coalesced_bounded_and_chunked() -> None:
    sync = sync_for("me", max_pending_bindings=300)
    sync.publish_binding("session", "s", E1, 60.0)
    sync.publish_binding("session", "s", E2, 60.0)  # the latest binding of a key wins
    for i in range(400):
        sync.publish_binding("response", f"r{i}", E3, 60.0)
    assert sync.bindings_dropped == 101  # 1 + 299 kept
    messages = sync._affinity_messages()
    decoded = [msgspec.msgpack.decode(m) for m in messages]
    assert [len(d[2]) for d in decoded] == [256, 44]
    assert decoded[0][:2] == [AFFINITY_VERSION, "me"]
    assert decoded[0][2][0] == ["session", "s", E2, 60.0]
    assert sync._affinity_messages() == []  # sent once


def replica(name: str, url: str) -> tuple[Dispatcher, NatsReplicaSync]:
    """A dispatcher with session affinity and its replica sync, wired as the gateway does."""
    sessions = SessionAffinity()
    dispatcher = Dispatcher(create_policy("round_robin", PolicyContext()), sessions=sessions)
    sync = NatsReplicaSync(url, dict, PeerLoad(name), interval_s=0.01)
    sync.share_table("session", sessions.table)
    sessions.on_bind = lambda key, engine, ttl: sync.publish_binding("session", key, engine, ttl)
    return dispatcher, sync


def turn(i: int, session: str = "agent-7") -> RequestInfo:
    return RequestInfo(f"r{i}", (), 16, 0.0, session=session)


async def test_a_session_bound_on_one_replica_is_routed_there_by_another(nats: Service) -> None:
    (da, sa), (db, sb) = replica("a", nats.url), replica("b", nats.url)
    for s in (sa, sb):
        s.start()
    try:
        await until(lambda: sa.connected and sb.connected)
        # each has a message from the other: the server has processed the other's
        # subscriptions, sent on its connection before its first publish
        await until(lambda: sa.peers.received > 0 and sb.peers.received > 0)
        da.route(turn(0, session=""), VIEW, time.monotonic())
        da.route(turn(1, session=""), VIEW, time.monotonic())
        engine = da.route(turn(2), VIEW, time.monotonic()).engine
        assert engine == E3  # round robin's third pick on A; B's first pick would be E1
        await until(lambda: sb.bindings_applied > 0)
        assert db.route(turn(3), VIEW, time.monotonic()).engine == E3
        assert db.sessions is not None and db.sessions.outcomes == {"bound": 1}
    finally:
        for s in (sa, sb):
            await s.stop()
