"""Replica load sync: every gateway replica shares its router-side load over NATS.

A replica knows exactly what *it* has in flight on each engine (the dispatcher's
count) and the prompt tokens it sent there that have not produced a first token
(the registry's pending prefill). With N replicas that is about 1/N of each
engine's load. With ``replica_sync.nats_url`` set, each replica publishes a
snapshot ``{engine: [in_flight, pending_prefill_tokens]}`` on a NATS core subject
as soon as it routes a request (:meth:`NatsReplicaSync.poke`, called when prompt
tokens are added to or cleared from an engine's pending prefill), otherwise when it
changed (checked every ``interval_s``: finished requests) and at least every
``heartbeat_s``; every replica keeps the latest
snapshot of each peer and adds the peers' numbers to its own in the
:class:`~gateway.core.types.EngineView` (:meth:`PeerLoad.of`). A peer that stops
publishing is dropped after ``ttl_s`` (a replica shutting down says so at once),
so a dead replica's load does not linger. As Dynamo's ``--router-replica-sync``,
this is NATS core pub/sub, fire and forget: a lost message is repaired by the next
snapshot (snapshots, not deltas). No replica is special; N identical processes with
the same settings form one group (per ``subject``).

Memory: one snapshot per live peer (engines x 2 integers). Staleness of a peer's
numbers: a routing decision reaches the peers after one event-loop turn plus NATS
delivery (about a millisecond on one host); a finished request within ``interval_s``.

**Affinity bindings.** Key -> engine tables (:class:`~gateway.policies.affinity_table.
AffinityTable`) registered by name with :meth:`NatsReplicaSync.share_table` are shared
too: :meth:`NatsReplicaSync.publish_binding` (table name, key, engine, TTL) queues a
binding, sent with the others of the same event-loop turn on ``SUBJECT.affinity``;
each peer puts it into its own table of that name for the remaining TTL (a table
nobody registered is skipped). The gateway shares ``session`` (a session's engine,
published at each of its turns) and ``response`` (the engine that stored a Responses
API response). Messages are ``[version, replica, [[table, key, engine, ttl_s], ..]]``
(msgpack, version :data:`AFFINITY_VERSION`); a replica ignores other versions, and a
replica older than this format never subscribes to that subject. Bounded: at most
``max_pending_bindings`` queued (more are dropped and counted: fire and forget, the
next turn of a session publishes it again), :data:`BINDINGS_PER_MESSAGE` per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.policies.affinity_table import AffinityTable

log = logging.getLogger("kvgate.replicas")

Snapshot = dict[str, tuple[int, int]]
"""engine id -> (requests in flight, prompt tokens pending prefill)."""


class _Message(msgspec.Struct, array_like=True):
    replica: str
    seq: int
    loads: dict[str, tuple[int, int]]
    bye: bool = False


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(_Message)

AFFINITY_VERSION = 1
"""Version of the affinity messages; a replica applies only its own version."""
BINDINGS_PER_MESSAGE = 256
Binding = tuple[str, str, str, float]
"""(table name, key, engine, remaining TTL in seconds)."""


class _Affinity(msgspec.Struct, array_like=True):
    version: int
    replica: str
    bindings: list[Binding]


def default_replica_id() -> str:
    """host-pid-random: unique per process, readable in logs."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(slots=True)
class _Peer:
    seq: int
    seen: float
    loads: Snapshot


class PeerLoad:
    """The latest snapshot of every live peer, summed per engine."""

    def __init__(
        self, replica_id: str, *, ttl_s: float = 3.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        self.clock = clock
        self._peers: dict[str, _Peer] = {}
        self._sum: Snapshot = {}
        self.received = 0
        self.rejected = 0

    @property
    def peers(self) -> list[str]:
        """Live peers (expired ones dropped)."""
        self._expire()
        return sorted(self._peers)

    def apply(self, data: bytes) -> None:
        """One message from the subject (ours and malformed ones are ignored)."""
        try:
            msg = _DEC.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.rejected += 1
            return
        if msg.replica == self.replica_id:
            return
        self.received += 1
        if msg.bye:
            if self._peers.pop(msg.replica, None) is not None:
                self._resum()
            return
        old = self._peers.get(msg.replica)
        if old is not None and msg.seq <= old.seq:
            return  # reordered or repeated
        self._peers[msg.replica] = _Peer(msg.seq, self.clock(), dict(msg.loads))
        self._resum()

    def of(self, engine: str) -> tuple[int, int]:
        """(in flight, pending prefill tokens) the live peers have on ``engine``."""
        self._expire()
        return self._sum.get(engine, (0, 0))

    def _expire(self) -> None:
        horizon = self.clock() - self.ttl_s
        dead = [r for r, p in self._peers.items() if p.seen < horizon]
        if dead:
            for r in dead:
                del self._peers[r]
                log.warning("replica %s stopped publishing its load: dropped", r)
            self._resum()

    def _resum(self) -> None:
        total: dict[str, list[int]] = {}
        for p in self._peers.values():
            for engine, (n, tokens) in p.loads.items():
                acc = total.setdefault(engine, [0, 0])
                acc[0] += n
                acc[1] += tokens
        self._sum = {e: (v[0], v[1]) for e, v in total.items()}


class NatsReplicaSync:
    """Publishes this replica's load and receives the peers' (see the module docstring)."""

    def __init__(
        self,
        url: str,
        local: Callable[[], Mapping[str, tuple[int, int]]],
        peers: PeerLoad,
        *,
        subject: str = "kvgate.load",
        interval_s: float = 0.02,
        heartbeat_s: float = 1.0,
        max_pending_bindings: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.local = local
        self.peers = peers
        self.subject = subject
        self.affinity_subject = f"{subject}.affinity"
        self.clock = clock
        """The clock the shared tables are read with (the dispatcher's ``now``)."""
        self.max_pending_bindings = max_pending_bindings
        self._tables: dict[str, AffinityTable] = {}
        self._pending: dict[tuple[str, str], tuple[str, float]] = {}
        self.bindings_published = 0
        self.bindings_applied = 0
        self.bindings_dropped = 0
        self.bindings_rejected = 0
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        self.published = 0
        self.connect_failures = 0
        """Failed connection attempts and transport errors (no server yet, a lost link): the
        sync keeps retrying."""
        self._seq = 0
        self._nc: Any = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def poke(self) -> None:
        """Our load just changed: publish it now (coalesced with other changes this turn)."""
        self._wake.set()

    def share_table(self, name: str, table: AffinityTable) -> None:
        """Apply the peers' bindings of table ``name`` to ``table`` (this replica's)."""
        self._tables[name] = table

    def publish_binding(self, table: str, key: str, engine: str, ttl_s: float) -> None:
        """Tell the peers that ``key`` of ``table`` is bound to ``engine`` for ``ttl_s``.

        Never blocks: queued for this turn's message (the latest binding of a key wins);
        past ``max_pending_bindings`` queued it is dropped and counted."""
        pending = self._pending
        slot = (table, key)
        if slot not in pending and len(pending) >= self.max_pending_bindings:
            self.bindings_dropped += 1
            return
        pending[slot] = (engine, ttl_s)
        self._wake.set()

    def apply_affinity(self, data: bytes) -> None:
        """One message from ``SUBJECT.affinity`` (ours, other versions, malformed: ignored)."""
        try:
            raw = msgspec.msgpack.decode(data)
            if not isinstance(raw, list) or not raw or raw[0] != AFFINITY_VERSION:
                raise msgspec.ValidationError("not an affinity message of this version")
            msg = msgspec.convert(raw, _Affinity)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.bindings_rejected += 1
            return
        if msg.replica == self.peers.replica_id:
            return
        now = self.clock()
        for name, key, engine, ttl_s in msg.bindings:
            table = self._tables.get(name)
            if table is not None and ttl_s > 0:
                table.put(key, engine, now, ttl_s=min(ttl_s, table.ttl_s))
                self.bindings_applied += 1

    def _affinity_messages(self) -> list[bytes]:
        """The queued bindings as messages (and the queue emptied)."""
        items = [(t, k, e, ttl) for (t, k), (e, ttl) in self._pending.items()]
        self._pending = {}
        me = self.peers.replica_id
        return [
            _ENC.encode(_Affinity(AFFINITY_VERSION, me, items[i : i + BINDINGS_PER_MESSAGE]))
            for i in range(0, len(items), BINDINGS_PER_MESSAGE)
        ]

    @property
    def connected(self) -> bool:
        return self._nc is not None and bool(self._nc.is_connected)

    def start(self) -> None:
        """Connect (retrying in the background) and publish until :meth:`stop`."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvgate-replica-sync")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        nc, self._nc = self._nc, None
        if nc is not None:
            with contextlib.suppress(Exception):
                if nc.is_connected:  # tell the peers at once instead of after ttl_s
                    await nc.publish(self.subject, self._encode({}, bye=True))
                    await nc.flush(timeout=1)
            with contextlib.suppress(Exception):
                await nc.close()

    async def _connect(self) -> Any:
        import nats  # the optional transport; imported only when configured

        delay = 0.2
        while True:
            try:
                return await nats.connect(
                    servers=[self.url],
                    name=self.peers.replica_id,
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    error_cb=self._on_error,
                )
            except Exception as exc:  # no server yet: keep routing on our own load, retry
                self.connect_failures += 1
                log.warning("replica sync: cannot reach %s (%r); retrying", self.url, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _on_error(self, exc: Exception) -> None:
        self.connect_failures += 1
        level = logging.WARNING if self.connect_failures % 100 == 1 else logging.DEBUG
        log.log(level, "replica sync: %s: %r (retrying)", self.url, exc)

    async def _on_msg(self, msg: Any) -> None:
        self.peers.apply(msg.data)

    async def _on_affinity(self, msg: Any) -> None:
        self.apply_affinity(msg.data)

    def _encode(self, loads: Snapshot, *, bye: bool = False) -> bytes:
        self._seq += 1
        return _ENC.encode(_Message(self.peers.replica_id, self._seq, loads, bye))

    async def _run(self) -> None:
        self._nc = nc = await self._connect()
        await nc.subscribe(self.subject, cb=self._on_msg)
        await nc.subscribe(self.affinity_subject, cb=self._on_affinity)
        log.info(
            "replica load sync on",
            extra={"url": self.url, "subject": self.subject, "replica": self.peers.replica_id},
        )
        last: Snapshot | None = None
        last_sent = 0.0
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            snap = {e: (int(n), int(t)) for e, (n, t) in self.local().items() if n or t}
            if (snap != last or now - last_sent >= self.heartbeat_s) and nc.is_connected:
                try:
                    await nc.publish(self.subject, self._encode(snap))
                    self.published += 1
                    last, last_sent = snap, now
                except Exception as exc:  # reconnecting: the next round sends the snapshot
                    log.debug("replica sync publish failed: %r", exc)
            if self._pending and nc.is_connected:
                sent = len(self._pending)
                try:
                    for data in self._affinity_messages():
                        await nc.publish(self.affinity_subject, data)
                    self.bindings_published += sent
                except Exception as exc:  # fire and forget: the next turn publishes again
                    log.debug("replica sync: bindings not published: %r", exc)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()
