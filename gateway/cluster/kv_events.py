"""vLLM KV-cache events: subscribe, decode, keep sequence, feed the policies.

Each engine (each DP rank) publishes on a ZMQ PUB socket: multipart
``[topic, seq (8-byte big-endian), payload]`` where ``payload`` is msgpack of
``[ts, [event, ...], dp_rank]``. Events are maps tagged ``"type"`` in vLLM
0.30+ (``{"type": "BlockStored", "block_hashes": [...], ...}``) and tagged
arrays in 0.11/0.20 (``["BlockStored", block_hashes, parent, ...]``); both are
decoded. Block hashes are 64-bit ints by default, or 32-byte digests (their
low 64 bits are used). Only the device tier (``medium`` GPU, or absent) counts.

Sequence numbers are tracked per (engine, rank). On a gap the subscriber asks
the engine's replay socket (ROUTER) for the missing batches; without one, or
if replay fails, the engine's cached state is reset (policies forget it and
model it again until new events arrive). Memory: a bounded receive queue
(ZMQ's high-water mark) and one integer per (engine, rank).
"""

from __future__ import annotations

import asyncio
import contextlib
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
    """What one event batch changed on one engine."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False


def _hash_id(h: Any) -> int:
    if isinstance(h, int):
        return h & ((1 << 64) - 1)
    if isinstance(h, bytes | bytearray):
        return event_id(bytes(h))
    raise ValueError(f"unexpected block hash {h!r}")


def decode_batch(payload: bytes) -> tuple[int, CacheDelta]:
    """(dp_rank, changes) of one published batch, in either wire format."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None
    if not isinstance(batch, list | tuple) or len(batch) < 2:
        raise ValueError("a KV event batch is an array [ts, events, dp_rank]")
    rank = batch[2] if len(batch) > 2 and isinstance(batch[2], int) else 0
    delta = CacheDelta()
    for event in batch[1]:
        if isinstance(event, dict):  # vLLM >= 0.30: tagged map
            kind = event.get("type")
            hashes = event.get("block_hashes") or []
            medium = event.get("medium")
        elif isinstance(event, list | tuple) and event:  # 0.11 / 0.20: tagged array
            kind = event[0]
            hashes = event[1] if len(event) > 1 else []
            at = 6 if kind == "BlockStored" else 2  # where `medium` sits in each array
            medium = event[at] if len(event) > at else None
        else:
            continue
        if kind == "AllBlocksCleared":
            delta.cleared = True
            delta.stored.clear()
            delta.removed.clear()
        elif medium not in _DEVICE:
            continue
        elif kind == "BlockStored":
            delta.stored.extend(_hash_id(h) for h in hashes)
        elif kind == "BlockRemoved":
            delta.removed.extend(_hash_id(h) for h in hashes)
    return rank, delta


Listener = Callable[[str, CacheDelta], None]
"""Called with (engine id, changes); a ``cleared`` delta also stands for a reset."""


@dataclass(slots=True)
class Source:
    """One engine's publisher (one per DP rank) and its optional replay socket."""

    engine: str
    endpoint: str
    replay: str | None = None
    topic: bytes = b""


class KVEventSubscriber:
    """Receives every configured engine's events on the running asyncio loop."""

    def __init__(
        self, listener: Listener, *, hwm: int = 100_000, replay_timeout_s: float = 2.0
    ) -> None:
        self.listener = listener
        self.hwm = hwm
        self.replay_timeout_s = replay_timeout_s
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._seq: dict[tuple[str, int], int] = {}
        self.batches = 0
        self.gaps = 0
        self.resets = 0
        self.errors = 0

    def start(self, sources: Iterable[Source]) -> None:
        for src in sources:
            key = f"{src.engine}|{src.endpoint}"
            if key not in self._tasks:
                self._tasks[key] = asyncio.create_task(self._run(src), name=f"kv-events {key}")

    def subscribed(self, engine: str) -> bool:
        """True while some publisher of ``engine`` is being received."""
        return any(k.startswith(engine + "|") for k in self._tasks)

    def stop_engine(self, engine: str) -> None:
        for key in [k for k in self._tasks if k.startswith(engine + "|")]:
            self._tasks.pop(key).cancel()
        for k in [k for k in self._seq if k[0] == engine]:
            del self._seq[k]

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._ctx.destroy(linger=0)

    async def _run(self, src: Source) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.setsockopt(zmq.SUBSCRIBE, src.topic)
        sock.connect(src.endpoint)
        log.info("subscribed to KV events", extra={"engine": src.engine, "endpoint": src.endpoint})
        try:
            while True:
                frames = await sock.recv_multipart()
                await self._handle(src, frames)
        finally:
            sock.close(linger=0)

    async def _handle(self, src: Source, frames: list[bytes]) -> None:
        if len(frames) == 3:
            _, seq_raw, payload = frames
        elif len(frames) == 2:
            seq_raw, payload = frames
        else:
            self.errors += 1
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
        if last is not None and seq != last + 1:
            self.gaps += 1
            if seq <= last:  # the engine restarted: its counter began again
                self._reset(src.engine, "publisher restarted")
            elif not await self._replay(src, last + 1, seq):
                self._reset(src.engine, f"missed batches {last + 1}..{seq - 1}")
        self._seq[key] = seq
        self.batches += 1
        self.listener(src.engine, delta)

    async def _replay(self, src: Source, start: int, stop: int) -> bool:
        """Fetch batches ``start..stop-1`` from the replay socket; True when all arrived."""
        if src.replay is None:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(src.replay)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            expected = start
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), self.replay_timeout_s)
                frames = [f for f in frames if f != b""] if len(frames) > 3 else frames
                seq_raw = frames[-2] if len(frames) >= 2 else END_SEQ
                if seq_raw == END_SEQ:
                    return expected >= stop
                seq = int.from_bytes(seq_raw, "big", signed=True)
                if seq >= stop:
                    continue
                _, delta = decode_batch(frames[-1])
                self.listener(src.engine, delta)
                expected = seq + 1
        except (TimeoutError, zmq.ZMQError, ValueError) as exc:
            log.warning("KV event replay from %s failed: %s", src.engine, exc)
            return False
        finally:
            sock.close(linger=0)

    def _reset(self, engine: str, why: str) -> None:
        self.resets += 1
        log.warning("KV events of %s out of sync (%s): its cached state is reset", engine, why)
        self.listener(engine, CacheDelta(cleared=True))


def resolve_sources(engine: str, host: str, config: dict[str, Any]) -> list[Source]:
    """Sources from an engine's ``GET /kv_event_sources`` answer (one entry per DP rank).

    Publishers offset their port by the DP rank; when every rank reports the same
    configured endpoint, the offset is applied here.
    """
    ranks = sorted(
        (int(r), c)
        for r, c in config.items()
        if isinstance(c, dict)
        and c.get("enable_kv_cache_events")
        and c.get("publisher", "zmq") == "zmq"
    )
    same = len({c.get("endpoint") for _, c in ranks}) == 1 and len(ranks) > 1
    out = []
    for rank, cfg in ranks:
        offset = rank if same else 0
        replay = cfg.get("replay_endpoint")
        out.append(
            Source(
                engine=engine,
                endpoint=_bound_to(cfg.get("endpoint", "tcp://*:5557"), host, offset),
                replay=_bound_to(replay, host, offset) if replay else None,
                topic=str(cfg.get("topic", "")).encode(),
            )
        )
    return out


def _bound_to(endpoint: str, host: str, rank: int) -> str:
    """A connectable address for a bound endpoint, its port offset by ``rank``."""
    scheme, _, rest = endpoint.partition("://")
    addr, _, port = rest.rpartition(":")
    if addr in ("*", "0.0.0.0", "::", "[::]", ""):
        addr = host
    if port.isdigit() and int(port):
        port = str(int(port) + rank)
    return f"{scheme}://{addr}:{port}"
