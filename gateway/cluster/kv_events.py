"""vLLM KV-cache events: subscribe, decode, keep sequence, feed the policies.

Each engine (each DP rank) publishes on a ZMQ PUB socket: multipart
``[topic, seq (8-byte big-endian), payload]`` where ``payload`` is msgpack of
``[ts, [event, ...], dp_rank]``. Events are maps tagged ``"type"`` in vLLM
0.30+ (``{"type": "BlockStored", "block_hashes": [...], ...}``) and tagged
arrays in 0.11/0.20 (``["BlockStored", block_hashes, parent, ...]``); both are
decoded. Block hashes are 64-bit ints by default, or 32-byte digests (their
low 64 bits are used). Only the device tier (``medium`` GPU, or absent) counts.

On subscribing, the subscriber first asks the replay socket (when the engine has one)
for every batch it still buffers, from seq 0 on (``catch_up``): a gateway replica that
starts or restarts after the engine thus rebuilds what the engine cached, as far back
as the engine's replay buffer reaches (vLLM's ``buffer_steps``, 10,000 batches);
live batches the replay already delivered are then skipped. Until the first live batch
arrives, the replay socket is asked again (from the last seq seen) at 0.5, 1, 2, 4 and 8 s:
ZMQ's slow joiner drops what is published before the subscription reaches the publisher,
and when nothing follows, no gap would ever show it. When something does follow, a
catch-up that found nothing from seq ``s`` on makes a first live batch past ``s`` a gap.

Sequence numbers are tracked per (engine, rank). On a gap the subscriber asks
the engine's replay socket (ROUTER) for the missing batches; without one, or
if replay fails or cannot fill the whole gap, the engine's cached state is
reset (policies forget it and model it again until new events arrive); a
sequence number going back (a restarted publisher) resets it too. Memory: a
bounded receive queue per publisher (ZMQ's receive high-water mark, ``hwm``
batches; beyond it ZMQ drops, which shows up as a gap), replies streamed one
batch at a time, and one integer per (engine, rank), dropped by ``stop_engine``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from gateway.core.vllm_hash import event_id

log = logging.getLogger("kvgate.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_DEVICE = {None, "GPU", "gpu", "device"}


@dataclass(slots=True)
class CacheDelta:
    """What one event batch changed on one engine.

    ``stored`` and ``removed`` are disjoint: a block stored and removed within one
    batch counts only as its last change, so they may be applied in either order.
    ``cleared`` means the engine's whole cache is gone (``AllBlocksCleared``, or
    ``lost`` events); ``stored`` then lists what it holds after the clear.
    """

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False
    lost: bool = False
    """Synthetic: events were lost (a gap replay could not fill, or a restarted
    publisher), so the engine's state is unknown. No batch stands behind it."""


def _hash_id(h: Any) -> int:
    if isinstance(h, int) and not isinstance(h, bool):
        return h & ((1 << 64) - 1)
    if isinstance(h, bytes | bytearray):
        return event_id(bytes(h))
    raise ValueError(f"unexpected block hash {h!r}")


def _hash_list(hashes: Any) -> list[int]:
    if hashes is None:
        return []
    if not isinstance(hashes, list | tuple):
        raise ValueError(f"block_hashes is not an array: {hashes!r}")
    return [_hash_id(h) for h in hashes]


def decode_batch(payload: bytes) -> tuple[int, CacheDelta]:
    """(dp_rank, changes) of one published batch, in either wire format.

    Anything that is not a well-formed batch raises ``ValueError``.
    """
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None
    if not isinstance(batch, list | tuple) or len(batch) < 2:
        raise ValueError("a KV event batch is an array [ts, events, dp_rank]")
    events = batch[1]
    if not isinstance(events, list | tuple):
        raise ValueError(f"a KV event batch's events are an array, not {type(events).__name__}")
    rank = batch[2] if len(batch) > 2 else None
    if rank is None:
        rank = 0
    elif not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"bad data_parallel_rank {rank!r}")
    # Ordered sets: the last change of a block wins (see CacheDelta).
    stored: dict[int, None] = {}
    removed: dict[int, None] = {}
    cleared = False
    for event in events:
        if isinstance(event, dict):  # vLLM >= 0.30: tagged map
            kind = event.get("type")
            hashes = event.get("block_hashes")
            medium = event.get("medium")
        elif isinstance(event, list | tuple) and event:  # 0.11 / 0.20: tagged array
            kind = event[0]
            hashes = event[1] if len(event) > 1 else None
            at = 6 if kind == "BlockStored" else 2  # where `medium` sits in each array
            medium = event[at] if len(event) > at else None
        else:
            raise ValueError(f"not a KV cache event: {event!r}")
        if not isinstance(kind, str):
            raise ValueError(f"KV cache event without a type tag: {event!r}")
        if medium is not None and not isinstance(medium, str):
            raise ValueError(f"bad medium {medium!r}")
        if kind == "AllBlocksCleared":
            cleared = True
            stored.clear()
            removed.clear()
        elif medium not in _DEVICE:  # another tier (CPU offload, storage)
            continue
        elif kind == "BlockStored":
            for h in _hash_list(hashes):
                removed.pop(h, None)
                stored[h] = None
        elif kind == "BlockRemoved":
            for h in _hash_list(hashes):
                stored.pop(h, None)
                removed[h] = None
        # other (future) event types carry nothing a router models
    return rank, CacheDelta(list(stored), list(removed), cleared)


Listener = Callable[[str, CacheDelta], None]
"""Called with (engine id, changes); a ``cleared`` delta also stands for a reset."""


@dataclass(slots=True)
class Source:
    """One engine's publisher (one per DP rank) and its optional replay socket."""

    engine: str
    endpoint: str
    replay: str | None = None
    topic: bytes = b""


JOIN_CHECKS_S = (0.5, 1.0, 2.0, 4.0, 8.0)
"""Idle waits after which a subscription without a live batch yet asks the replay socket."""


class KVEventSubscriber:
    """Receives every configured engine's events on the running asyncio loop."""

    def __init__(
        self,
        listener: Listener,
        *,
        hwm: int = 100_000,
        replay_timeout_s: float = 2.0,
        catch_up: bool = True,
    ) -> None:
        self.listener = listener
        self.hwm = hwm
        self.replay_timeout_s = replay_timeout_s
        self.catch_up = catch_up
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._seq: dict[tuple[str, int], int] = {}
        self._source_seq: dict[str, int] = {}
        """The latest seq delivered from each publisher endpoint (one integer per source), or
        one before the seq a catch-up that delivered nothing started from."""
        self._caught_up: set[tuple[str, int]] = set()
        self._catching: set[asyncio.Task[None]] = set()
        self._catch_done = asyncio.Event()
        self._catch_done.set()
        """Keys whose sequence came from a catch-up replay: live duplicates are skipped."""
        self.batches = 0
        """Batches delivered, replayed ones included."""
        self.replayed = 0
        self.gaps = 0
        self.resets = 0
        self.errors = 0

    def start(self, sources: Iterable[Source]) -> None:
        for src in sources:
            key = (src.engine, src.endpoint)
            if key not in self._tasks:
                task = asyncio.create_task(self._run(src), name=f"kv-events {src.engine}")
                self._tasks[key] = task
                task.add_done_callback(functools.partial(self._ended, key))

    async def caught_up(self, timeout: float) -> bool:
        """Wait until every started subscription finished its catch-up replay (or failed
        it); False when ``timeout`` passed first."""
        await asyncio.sleep(0)  # let freshly started tasks begin their catch-up
        try:
            async with asyncio.timeout(timeout):
                await self._catch_done.wait()
        except TimeoutError:
            return False
        return True

    def subscribed(self, engine: str) -> bool:
        """True while some publisher of ``engine`` is being received."""
        return any(k[0] == engine for k in self._tasks)

    def stop_engine(self, engine: str) -> None:
        for key in [k for k in self._tasks if k[0] == engine]:
            self._source_seq.pop(key[1], None)
            task = self._tasks.pop(key)
            task.cancel()
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        for k in [k for k in self._seq if k[0] == engine]:
            del self._seq[k]
            self._caught_up.discard(k)

    async def aclose(self) -> None:
        tasks = [*self._tasks.values(), *self._stopping]
        self._tasks.clear()
        pending = set(tasks)
        for _ in range(5):  # a cancellation a task swallowed is repeated, a bounded number of times
            if not pending:
                break
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        if pending:
            log.error("%d KV event tasks did not end when cancelled", len(pending))
        self._ctx.destroy(linger=0)

    def _ended(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        """A receive task ended: forget it, so the engine may be subscribed again."""
        if self._tasks.get(key) is task:
            del self._tasks[key]
        if not task.cancelled() and task.exception() is not None:
            self.errors += 1
            log.error(
                "KV event subscription to %s (%s) failed: %r", key[0], key[1], task.exception()
            )

    def _socket(self, kind: int, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        if "://[" in endpoint:  # an IPv6 literal
            sock.setsockopt(zmq.IPV6, 1)
        return sock

    async def _run(self, src: Source) -> None:
        sock = self._socket(zmq.SUB, src.endpoint)
        try:
            sock.setsockopt(zmq.RCVHWM, self.hwm)  # before connect, or it does not apply
            sock.setsockopt(zmq.SUBSCRIBE, src.topic)
            sock.connect(src.endpoint)
            log.info(
                "subscribed to KV events", extra={"engine": src.engine, "endpoint": src.endpoint}
            )
            if self.catch_up and src.replay is not None:
                task = asyncio.current_task()
                assert task is not None
                self._catching.add(task)
                self._catch_done.clear()
                try:
                    await self._catch_up(src)
                finally:
                    self._catching.discard(task)
                    if not self._catching:
                        self._catch_done.set()
                await self._await_join(sock, src)
            while True:
                frames = await sock.recv_multipart()
                await self._handle(src, frames)
        finally:
            sock.close(linger=0)

    async def _await_join(self, sock: zmq.asyncio.Socket, src: Source) -> None:
        """Ask the replay socket again while no live batch has come (see the module doc)."""
        for wait_s in JOIN_CHECKS_S:
            if await sock.poll(timeout=int(wait_s * 1000)):
                return
            await self._catch_up(src, self._source_seq.get(src.endpoint, -1) + 1)

    def _deliver(self, engine: str, delta: CacheDelta) -> None:
        try:
            self.listener(engine, delta)
        except Exception:  # a listener bug must not end the subscription
            self.errors += 1
            log.exception("KV event listener failed for %s", engine)

    async def _handle(self, src: Source, frames: list[bytes]) -> None:
        if len(frames) == 3:
            _, seq_raw, payload = frames
        elif len(frames) == 2:
            seq_raw, payload = frames
        else:
            self.errors += 1
            return
        if len(seq_raw) != 8:
            self.errors += 1
            log.warning("KV event batch from %s without an 8-byte sequence number", src.engine)
            return
        seq = int.from_bytes(seq_raw, "big", signed=True)
        try:
            rank, delta = decode_batch(payload)
        except ValueError as exc:
            self.errors += 1
            log.warning("undecodable KV event batch from %s: %s", src.engine, exc)
            return
        key = (src.engine, rank)
        last = self._seq.get(key)
        if last is None:  # a catch-up that found nothing from some seq on sets where it began
            last = self._source_seq.get(src.endpoint)
        if key in self._caught_up:
            if last is not None and seq <= last:
                return  # the catch-up replay delivered it already
            self._caught_up.discard(key)
        if last is not None and seq != last + 1:
            self.gaps += 1
            if seq <= last:  # the engine restarted: its counter began again
                self._reset(src.engine, "publisher restarted")
            elif not await self._replay(src, last + 1, seq):
                self._reset(src.engine, f"missed batches {last + 1}..{seq - 1}")
        self._seq[key] = seq
        self._source_seq[src.endpoint] = seq
        self.batches += 1
        self._deliver(src.engine, delta)

    async def _replay(self, src: Source, start: int, stop: int) -> bool:
        """Deliver batches ``start..stop-1`` from the replay socket; True when all arrived.

        vLLM's replay server answers ``[b"", start_seq]`` with every batch it still
        buffers from ``start_seq`` on, as ``[b"", topic, seq, payload]`` (0.30+) or
        ``[b"", seq, payload]`` (0.11/0.20), then an end marker whose seq is -1.
        Batches are delivered as they arrive, so only a contiguous run counts.
        """
        if src.replay is None:
            return False
        sock = self._socket(zmq.DEALER, src.replay)
        timeout = self.replay_timeout_s
        try:
            sock.connect(src.replay)
            async with asyncio.timeout(timeout):
                await sock.send_multipart([b"", start.to_bytes(8, "big")])
            expected = start
            while True:
                async with asyncio.timeout(timeout):
                    frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]  # the envelope delimiter
                if len(frames) not in (2, 3) or len(frames[-2]) != 8:
                    raise ValueError(f"unexpected replay reply of {len(frames)} frames")
                if frames[-2] == END_SEQ:
                    if expected < stop:
                        log.warning(
                            "KV event replay from %s ended at %d, before %d",
                            src.engine,
                            expected,
                            stop,
                        )
                    return expected >= stop
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq < expected or seq >= stop:
                    continue  # already had it, or it comes on the live socket
                if seq > expected:  # the engine no longer buffers the batches between
                    log.warning(
                        "KV event replay from %s lacks %d..%d", src.engine, expected, seq - 1
                    )
                    return False
                _, delta = decode_batch(frames[-1])
                self.batches += 1
                self.replayed += 1
                self._deliver(src.engine, delta)
                expected = seq + 1
        except (TimeoutError, zmq.ZMQError, ValueError) as exc:
            log.warning("KV event replay from %s failed: %r", src.engine, exc)
            return False
        finally:
            sock.close(linger=0)

    async def _catch_up(self, src: Source, start: int = 0) -> None:
        """Deliver every batch the engine still buffers from ``start`` on (those before its
        oldest are gone)."""
        sock = self._socket(zmq.DEALER, src.replay or "")
        timeout = self.replay_timeout_s
        replayed = 0
        try:
            sock.connect(src.replay or "")
            async with asyncio.timeout(timeout):
                await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                async with asyncio.timeout(timeout):
                    frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) not in (2, 3) or len(frames[-2]) != 8:
                    raise ValueError(f"unexpected replay reply of {len(frames)} frames")
                if frames[-2] == END_SEQ:
                    # Nothing more was buffered from ``start`` on: a live batch past it
                    # reveals batches the slow joiner dropped (one publisher, one rank).
                    self._source_seq.setdefault(src.endpoint, start - 1)
                    break
                seq = int.from_bytes(frames[-2], "big", signed=True)
                rank, delta = decode_batch(frames[-1])
                key = (src.engine, rank)
                last = self._seq.get(key)
                if last is not None and seq <= last:
                    continue
                self._seq[key] = seq
                self._source_seq[src.endpoint] = seq
                self._caught_up.add(key)
                self.batches += 1
                self.replayed += 1
                replayed += 1
                self._deliver(src.engine, delta)
        except (TimeoutError, zmq.ZMQError, ValueError) as exc:
            log.warning("KV event catch-up from %s failed: %r", src.engine, exc)
        finally:
            sock.close(linger=0)
        if replayed:
            log.info("caught up on %d KV event batches of %s", replayed, src.engine)

    def _reset(self, engine: str, why: str) -> None:
        self.resets += 1
        log.warning("KV events of %s out of sync (%s): its cached state is reset", engine, why)
        self._deliver(engine, CacheDelta(cleared=True, lost=True))


def resolve_sources(engine: str, host: str, config: dict[str, Any]) -> list[Source]:
    """Sources from an engine's ``GET /kv_event_sources`` answer (one entry per DP rank).

    The answer maps each DP rank (a JSON key: ``"0"``, ``"1"``...) to its publisher's
    resolved ``KVEventsConfig``. Wildcard addresses are replaced by ``host`` (the
    engine's). Publishers offset their port by the DP rank and report the result;
    when every rank reports the same endpoint instead, the offset is applied here.
    ``inproc://`` endpoints (unreachable from another process) and malformed
    entries are skipped.
    """
    ranks: list[tuple[int, dict[str, Any]]] = []
    for r, c in config.items():
        try:
            rank = int(r)
        except (TypeError, ValueError):
            continue
        if (
            rank >= 0
            and isinstance(c, dict)
            and c.get("enable_kv_cache_events")
            and (c.get("publisher") or "zmq") == "zmq"
            and isinstance(c.get("endpoint", ""), str)
            and not str(c.get("endpoint", "")).startswith("inproc://")
        ):
            ranks.append((rank, c))
    ranks.sort(key=lambda rc: rc[0])
    same = len({c.get("endpoint") for _, c in ranks}) == 1 and len(ranks) > 1
    out = []
    for rank, cfg in ranks:
        offset = rank if same else 0
        replay = cfg.get("replay_endpoint")
        topic = cfg.get("topic") or ""
        out.append(
            Source(
                engine=engine,
                endpoint=_bound_to(cfg.get("endpoint") or "tcp://*:5557", host, offset),
                replay=_bound_to(replay, host, offset) if isinstance(replay, str) else None,
                topic=str(topic).encode(),
            )
        )
    return out


def _bound_to(endpoint: str, host: str, rank: int) -> str:
    """A connectable address for a bound endpoint, its port offset by ``rank``."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":  # ipc:// paths connect as they are
        return endpoint
    addr, _, port = rest.rpartition(":")
    if addr in ("*", "0.0.0.0", "::", "[::]", ""):
        addr = f"[{host}]" if ":" in host and not host.startswith("[") else host
    if port.isdigit() and int(port):
        port = str(int(port) + rank)
    return f"{scheme}://{addr}:{port}"
