"""KV event subscription against real in-process ZMQ publishers.

The publisher below follows vLLM's ``ZmqEventPublisher`` (../shared/docs/vllm-interface.md
section 2): a PUB socket sending ``[topic, seq (8-byte big-endian), payload]`` with
``payload`` the msgpack of ``[ts, events, dp_rank]``, and a ROUTER replay socket that
answers ``[b"", start_seq]`` with every buffered batch from ``start_seq`` on, then an end
marker whose seq is -1. Events are encoded with msgspec structs mirroring vLLM's: tagged
maps (0.30+) or tagged arrays (0.11/0.20). It is an XPUB, wire-compatible with PUB, so a
test can wait for the subscription instead of sleeping past ZMQ's slow-joiner window.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.cluster.kv_events import (
    CacheDelta,
    KVEventSubscriber,
    Source,
    decode_batch,
    resolve_sources,
)
from gateway.core.vllm_hash import block_digests, block_ids

END_SEQ = (-1).to_bytes(8, "big", signed=True)
TOKENS = list(range(1000, 1000 + 16 * 6))
IDS = block_ids(TOKENS, 16)  # six real chained block ids
M64 = (1 << 64) - 1


# -- vLLM's event structs, mirrored --------------------------------------------------------
class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    """0.30+: a map tagged ``"type"``, defaults omitted."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class Removed(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class Cleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True):
    pass


class Stored20(msgspec.Struct, tag="BlockStored", array_like=True):
    """0.20: a tagged array; trailing defaults are still encoded (as None)."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class Stored11(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class Removed20(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class Removed11(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[int | bytes]
    medium: str | None


class Cleared20(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


FORMATS = ("0.30", "0.20", "0.11")


def stored(hashes: list[int | bytes], fmt: str = "0.30", medium: str | None = "GPU") -> Any:
    tokens = list(range(16 * len(hashes)))
    if fmt == "0.30":
        return Stored(hashes, None, tokens, 16, None, medium, None, [None] * len(hashes), 0)
    if fmt == "0.20":
        return Stored20(hashes, None, tokens, 16, None, medium)
    return Stored11(hashes, None, tokens, 16, None, medium)


def removed(hashes: list[int | bytes], fmt: str = "0.30", medium: str | None = "GPU") -> Any:
    if fmt == "0.30":
        return Removed(hashes, medium, 0)
    if fmt == "0.20":
        return Removed20(hashes, medium, 0)
    return Removed11(hashes, medium)


def cleared(fmt: str = "0.30") -> Any:
    return Cleared() if fmt == "0.30" else Cleared20()


def payload(*events: Any, rank: int | None = 0) -> bytes:
    return msgspec.msgpack.encode(Batch(time.time(), list(events), rank))


# -- an in-process vLLM publisher ------------------------------------------------------------
class Publisher:
    """One DP rank's publisher: XPUB on 127.0.0.1 plus an optional ROUTER replay socket."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        rank: int = 0,
        topic: bytes = b"",
        replay: bool = True,
        legacy_replay: bool = False,
        buffer_steps: int = 10_000,
        port: int | None = None,
        sndhwm: int | None = None,
    ) -> None:
        self.rank, self.topic, self.legacy_replay = rank, topic, legacy_replay
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscription, not just the first
        if sndhwm is not None:
            self.pub.setsockopt(zmq.SNDHWM, sndhwm)
        if port is None:
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.port = port
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq = 0
        self.replay_requests: list[int] = []
        self.replay_mode = "ok"  # "ok" | "mute" (never answers) | "end" (only the end marker)
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self._serving: asyncio.Task[None] | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            self._serving = asyncio.create_task(self._serve())

    def source(self, engine: str) -> Source:
        return Source(engine, self.endpoint, self.replay_endpoint, self.topic)

    async def wait_subscribed(self) -> None:
        """The subscriber's subscription reached us: what we send now is delivered."""
        while True:  # b"\x00topic" are unsubscriptions (a subscriber that left)
            msg = await asyncio.wait_for(self.pub.recv(), 5.0)
            if msg[:1] == b"\x01":
                assert msg[1:] == self.topic
                return

    async def send(self, *events: Any, drop: bool = False, seq: int | None = None) -> int:
        """Publish one batch (``drop``: buffer it for replay only, as if lost on the way)."""
        return await self.send_raw(payload(*events, rank=self.rank), drop=drop, seq=seq)

    async def send_raw(self, data: bytes, *, drop: bool = False, seq: int | None = None) -> int:
        seq = self.next_seq if seq is None else seq
        self.next_seq = seq + 1
        self.buffer.append((seq, data))
        if not drop:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), data])
        return seq

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            client, _, start_raw = frames
            start = int.from_bytes(start_raw, "big")
            self.replay_requests.append(start)
            if self.replay_mode == "mute":
                continue
            if self.replay_mode == "ok":
                for seq, buf in list(self.buffer):
                    if seq >= start:
                        head = [client, b""] if self.legacy_replay else [client, b"", self.topic]
                        await self.router.send_multipart([*head, seq.to_bytes(8, "big"), buf])
            end = [END_SEQ, b""] if self.legacy_replay else [b"", END_SEQ, b""]
            await self.router.send_multipart([client, b"", *end])

    async def close(self) -> None:
        if self._serving is not None:
            self._serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._serving
            assert self.router is not None
            self.router.close(linger=0)
        self.pub.close(linger=0)


class Collector:
    def __init__(self) -> None:
        self.got: list[tuple[str, CacheDelta]] = []

    def __call__(self, engine: str, delta: CacheDelta) -> None:
        self.got.append((engine, delta))

    def of(self, engine: str) -> list[CacheDelta]:
        return [d for e, d in self.got if e == engine]

    async def wait(self, n: int, timeout: float = 5.0) -> None:
        await wait_until(lambda: len(self.got) >= n, timeout)


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        await asyncio.sleep(0.005)


async def quiet(seconds: float = 0.1) -> None:
    """Give in-flight messages time to arrive (for asserting that nothing does)."""
    await asyncio.sleep(seconds)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
async def make_pub(ctx: zmq.asyncio.Context) -> AsyncIterator[Callable[..., Publisher]]:
    made: list[Publisher] = []

    def make(**kw: Any) -> Publisher:
        made.append(Publisher(ctx, **kw))
        return made[-1]

    yield make
    for p in made:
        await p.close()


@pytest.fixture
async def collector() -> Collector:
    return Collector()


@pytest.fixture
async def sub(collector: Collector) -> AsyncIterator[KVEventSubscriber]:
    s = KVEventSubscriber(collector, replay_timeout_s=0.3, catch_up=False)
    yield s
    await s.aclose()


async def subscribe(sub: KVEventSubscriber, *pairs: tuple[str, Publisher]) -> None:
    sub.start([p.source(engine) for engine, p in pairs])
    for _, p in pairs:
        await p.wait_subscribed()


# -- decoding (no sockets) ---------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_stored_removed_cleared(fmt: str) -> None:
    rank, d = decode_batch(payload(stored(list(IDS[:3]), fmt), removed([IDS[5]], fmt), rank=0))
    assert (rank, d.stored, d.removed, d.cleared, d.lost) == (
        0,
        list(IDS[:3]),
        [IDS[5]],
        False,
        False,
    )
    # a clear drops what came before it in the batch, and keeps what came after
    _, d = decode_batch(
        payload(stored([IDS[0]], fmt), cleared(fmt), stored([IDS[1]], fmt), removed([7], fmt))
    )
    assert (d.stored, d.removed, d.cleared) == ([IDS[1]], [7], True)


def test_the_wire_shapes_are_the_documented_ones() -> None:
    """0.30+: maps with a "type" key; 0.20: tagged arrays padded with None; batch = array."""
    new = msgspec.msgpack.decode(payload(stored([5]), removed([5]), cleared(), rank=1))
    assert new[0] > 0 and new[2] == 1
    assert new[1][0]["type"] == "BlockStored" and new[1][0]["medium"] == "GPU"
    assert new[1][1] == {
        "type": "BlockRemoved",
        "block_hashes": [5],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert new[1][2] == {"type": "AllBlocksCleared"}
    old = msgspec.msgpack.decode(
        payload(stored([5], "0.20"), removed([5], "0.11"), cleared("0.20"))
    )
    assert old[1][0][:2] == ["BlockStored", [5]] and old[1][0][6] == "GPU"
    assert old[1][0][7:] == [None, None, None]
    assert old[1][1] == ["BlockRemoved", [5], "GPU"]
    assert old[1][2] == ["AllBlocksCleared"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_only_the_device_tier_counts(fmt: str) -> None:
    _, d = decode_batch(
        payload(
            stored([1], fmt, medium="CPU"),
            stored([2], fmt, medium=None),
            stored([3], fmt),
            removed([4], fmt, medium="STORAGE"),
            removed([5], fmt),
        )
    )
    assert (d.stored, d.removed) == ([2, 3], [5])


def test_block_hashes_as_digests_or_negative_ints_become_64_bit_ids() -> None:
    digests = block_digests(TOKENS, 16)
    _, d = decode_batch(payload(stored(list(digests[:2])), removed([-1])))
    assert d.stored == list(IDS[:2])  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: raw 32 bytes
    assert d.removed == [M64]


def test_a_block_changed_twice_in_one_batch_counts_as_its_last_change() -> None:
    # evicted, then recomputed and stored again by a later request of the same step
    _, d = decode_batch(payload(removed([IDS[0]]), stored([IDS[0], IDS[1]])))
    assert (d.stored, d.removed) == ([IDS[0], IDS[1]], [])
    _, d = decode_batch(payload(stored([IDS[0], IDS[1]]), removed([IDS[1]])))
    assert (d.stored, d.removed) == ([IDS[0]], [IDS[1]])


def test_rank_defaults_to_zero_and_unknown_events_are_skipped() -> None:
    batch = [1.0, [{"type": "SomethingNew", "x": 1}, {"type": "BlockRemoved", "block_hashes": [9]}]]
    assert decode_batch(msgspec.msgpack.encode(batch)) == (0, CacheDelta([], [9]))
    assert decode_batch(payload(stored([3]), rank=None))[0] == 0
    assert decode_batch(payload(stored([3]), rank=3))[0] == 3


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never used in msgpack
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode([1.0, 5, 0]),  # events not an array
        msgspec.msgpack.encode([1.0, [], "zero"]),
        msgspec.msgpack.encode([1.0, [7]]),  # an event that is no event
        msgspec.msgpack.encode([1.0, [[]]]),
        msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]),  # no type tag
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": 5}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": ["ab"]}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1.5]}]]),
        msgspec.msgpack.encode(
            [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": [1]}]]
        ),
        msgspec.msgpack.encode([1.0, [["BlockRemoved", {"a": 1}, "GPU"]]]),
    ],
)
def test_malformed_batches_raise_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_batch(data)


# -- sources -----------------------------------------------------------------------------------
def vllm_source(endpoint: str, **kw: Any) -> dict[str, Any]:
    """One rank of ``GET /kv_event_sources``: the publisher's resolved KVEventsConfig."""
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": None,
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "",
    }
    return cfg | kw


def test_resolve_sources_resolved_per_rank() -> None:
    # 0.33: each rank reports its own (already offset) endpoint
    config = {
        "1": vllm_source("tcp://*:5558", replay_endpoint="tcp://*:5568", topic="kv"),
        "0": vllm_source("tcp://*:5557", replay_endpoint="tcp://*:5567", topic="kv"),
    }
    assert resolve_sources("e", "10.0.0.7", config) == [
        Source("e", "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5567", b"kv"),
        Source("e", "tcp://10.0.0.7:5558", "tcp://10.0.0.7:5568", b"kv"),
    ]


def test_resolve_sources_applies_the_rank_offset_to_a_shared_endpoint() -> None:
    config = {
        str(r): vllm_source("tcp://*:5557", replay_endpoint="tcp://0.0.0.0:6000") for r in range(3)
    }
    got = resolve_sources("e", "h", config)
    assert [s.endpoint for s in got] == ["tcp://h:5557", "tcp://h:5558", "tcp://h:5559"]
    assert [s.replay for s in got] == ["tcp://h:6000", "tcp://h:6001", "tcp://h:6002"]
    # one rank: nothing to offset
    assert (
        resolve_sources("e", "h", {"0": vllm_source("tcp://*:5557")})[0].endpoint == "tcp://h:5557"
    )


def test_resolve_sources_keeps_explicit_hosts_and_bracketing() -> None:
    config = {
        "0": vllm_source("tcp://192.168.1.5:40123"),  # tcp://*:0 resolved to the node IP
        "1": vllm_source("tcp://[::]:5558"),
    }
    got = resolve_sources("e", "fd00::5", config)
    assert [s.endpoint for s in got] == ["tcp://192.168.1.5:40123", "tcp://[fd00::5]:5558"]
    assert resolve_sources("e", "h", {"0": vllm_source("ipc:///tmp/kv")})[0].endpoint == (
        "ipc:///tmp/kv"
    )


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"0": vllm_source("tcp://*:5557", enable_kv_cache_events=False)},
        {"0": vllm_source("tcp://*:5557", publisher="null")},
        {"0": vllm_source("inproc://cache")},  # unreachable from another process
        {"rank0": vllm_source("tcp://*:5557")},
        {"0": "tcp://*:5557"},
        {"0": vllm_source(None)},  # type: ignore[arg-type]
        {"0": vllm_source(5557)},  # type: ignore[arg-type]
    ],
)
def test_resolve_sources_skips_what_cannot_be_subscribed(config: dict[str, Any]) -> None:
    assert resolve_sources("e", "h", config) == []


# -- live subscription -----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
async def test_events_arrive_decoded(
    fmt: str, make_pub: Callable[..., Publisher], sub: KVEventSubscriber, collector: Collector
) -> None:
    pub = make_pub(topic=b"kv-events")
    await subscribe(sub, ("e1", pub))
    await pub.send(stored(list(IDS[:2]), fmt))
    await pub.send(removed([IDS[1]], fmt), stored([IDS[4]], fmt, medium="CPU"))
    await pub.send(cleared(fmt))
    await collector.wait(3)
    assert collector.got == [
        ("e1", CacheDelta(stored=list(IDS[:2]))),
        ("e1", CacheDelta(removed=[IDS[1]])),
        ("e1", CacheDelta(cleared=True)),
    ]
    assert (sub.batches, sub.gaps, sub.resets, sub.errors) == (3, 0, 0, 0)
    assert sub.subscribed("e1") and not sub.subscribed("e")


async def test_other_topics_are_not_received(
    make_pub: Callable[..., Publisher], sub: KVEventSubscriber, collector: Collector
) -> None:
    pub = make_pub(topic=b"kv")
    await subscribe(sub, ("e1", pub))
    await pub.pub.send_multipart([b"other", (0).to_bytes(8, "big"), payload(stored([1]))])
    await pub.send(stored([2]))
    await collector.wait(1)
    await quiet()
    assert collector.got == [("e1", CacheDelta(stored=[2]))]


async def test_sequence_numbers_are_tracked_per_engine_and_rank(
    make_pub: Callable[..., Publisher], sub: KVEventSubscriber, collector: Collector
) -> None:
    a0, a1, b0 = make_pub(rank=0), make_pub(rank=1), make_pub(rank=0)
    a1.next_seq, b0.next_seq = 500, 40  # each publisher counts on its own
    await subscribe(sub, ("a", a0), ("a", a1), ("b", b0))
    for i in range(5):
        await a0.send(stored([i]))
        await a1.send(stored([100 + i]))
        await b0.send(stored([200 + i]))
    await collector.wait(15)
    assert (sub.gaps, sub.resets) == (0, 0)
    assert sub._seq == {("a", 0): 4, ("a", 1): 504, ("b", 0): 44}
    # the ranks interleave freely; each rank's own order is kept
    assert [d.stored[0] for d in collector.of("a") if d.stored[0] < 100] == list(range(5))
    assert [d.stored[0] for d in collector.of("a") if d.stored[0] >= 100] == list(range(100, 105))
    # a gap on one rank with nothing to replay it resets that engine only
    a1.replay_mode = "end"
    await a1.send(stored([999]), drop=True)
    await a1.send(stored([105]))
    await collector.wait(17)
    assert collector.got[-2:] == [
        ("a", CacheDelta(cleared=True, lost=True)),
        ("a", CacheDelta([105])),
    ]
    assert (sub.gaps, sub.resets) == (1, 1)
    assert not any(d.cleared for d in collector.of("b"))


@pytest.mark.parametrize("legacy_replay", [False, True], ids=["0.30-replay", "0.20-replay"])
async def test_a_gap_is_filled_from_the_replay_socket(
    legacy_replay: bool,
    make_pub: Callable[..., Publisher],
    sub: KVEventSubscriber,
    collector: Collector,
) -> None:
    pub = make_pub(topic=b"kv", legacy_replay=legacy_replay)
    await subscribe(sub, ("e1", pub))
    for i in range(3):
        await pub.send(stored([i]))  # seq 0..2
    await collector.wait(3)
    await pub.send(stored([3]), drop=True)  # 3 and 4 never reach the subscriber
    await pub.send(removed([0]), stored([4]), drop=True)
    await pub.send(stored([5]))  # seq 5 reveals the gap
    await pub.send(stored([6]))
    await collector.wait(7)
    assert pub.replay_requests == [3]
    assert [(d.stored, d.removed) for _, d in collector.got] == [
        ([0], []),
        ([1], []),
        ([2], []),
        ([3], []),
        ([4], [0]),
        ([5], []),
        ([6], []),
    ]
    assert (sub.gaps, sub.resets, sub.replayed, sub.batches) == (1, 0, 2, 7)
    assert not any(d.cleared for _, d in collector.got)
    assert sub._seq == {("e1", 0): 6}


@pytest.mark.parametrize("mode", ["no replay socket", "mute", "end", "buffer too short"])
async def test_a_gap_that_replay_cannot_fill_resets_the_engine(
    mode: str, make_pub: Callable[..., Publisher], sub: KVEventSubscriber, collector: Collector
) -> None:
    pub = make_pub(
        replay=mode != "no replay socket", buffer_steps=2 if mode == "buffer too short" else 100
    )
    if mode in ("mute", "end"):
        pub.replay_mode = mode
    await subscribe(sub, ("e1", pub))
    await pub.send(stored([0]))
    await collector.wait(1)
    for i in range(1, 4):
        await pub.send(stored([i]), drop=True)  # 1..3 lost; a 2-batch buffer keeps only 2..3
    started = time.monotonic()
    await pub.send(stored([4]))
    await collector.wait(3)
    took = time.monotonic() - started
    assert collector.got[1:] == [
        ("e1", CacheDelta(cleared=True, lost=True)),
        ("e1", CacheDelta(stored=[4])),
    ]
    assert (sub.gaps, sub.resets, sub.replayed) == (1, 1, 0)
    assert pub.replay_requests == ([] if mode == "no replay socket" else [1])
    if mode == "mute":
        assert took >= sub.replay_timeout_s * 0.9
    assert took < 3.0


async def test_a_restarted_publisher_resets_the_engine(
    ctx: zmq.asyncio.Context,
    make_pub: Callable[..., Publisher],
    sub: KVEventSubscriber,
    collector: Collector,
) -> None:
    pub = make_pub(replay=False)
    await subscribe(sub, ("e1", pub))
    for i in range(4):
        await pub.send(stored([i]))
    await collector.wait(4)
    # the engine process restarts on the same port: its counter begins again at 0
    port = pub.port
    await pub.close()
    for _ in range(100):  # the old socket lets go of the port asynchronously
        try:
            again = make_pub(replay=False, port=port)
            break
        except zmq.ZMQError:
            await asyncio.sleep(0.02)
    await again.wait_subscribed()  # the subscriber reconnected by itself
    await again.send(stored([10]))
    await collector.wait(6)
    assert collector.got[4:] == [
        ("e1", CacheDelta(cleared=True, lost=True)),
        ("e1", CacheDelta(stored=[10])),
    ]
    assert (sub.gaps, sub.resets) == (1, 1)
    assert sub._seq == {("e1", 0): 0}


async def test_stop_engine_and_subscribe_again(
    make_pub: Callable[..., Publisher], sub: KVEventSubscriber, collector: Collector
) -> None:
    p1, p2 = make_pub(rank=0), make_pub(rank=1)
    other = make_pub()
    await subscribe(sub, ("e1", p1), ("e1", p2), ("e2", other))
    await p1.send(stored([1]))
    await p2.send(stored([2]))
    await collector.wait(2)
    assert sub.subscribed("e1") and sub.subscribed("e2")

    sub.stop_engine("e1")
    assert not sub.subscribed("e1") and sub.subscribed("e2")
    assert set(sub._seq) == set()  # e2 sent nothing yet
    await quiet()
    for _ in range(3):
        await p1.send(stored([3]))
    await other.send(stored([4]))
    await collector.wait(3)
    await quiet()
    assert collector.got[2:] == [("e2", CacheDelta([4]))]

    # re-added (as after an engine was removed and added again): no stale gap
    sub.start([p1.source("e1")])
    sub.start([p1.source("e1")])  # idempotent
    assert sub.subscribed("e1") and len(sub._tasks) == 2
    await p1.wait_subscribed()
    await p1.send(stored([5]))
    await collector.wait(4)
    assert collector.got[3] == ("e1", CacheDelta([5]))
    assert (sub.gaps, sub.resets) == (0, 0)


async def test_engine_ids_are_matched_whole(sub: KVEventSubscriber) -> None:
    sub.start([Source("a|b", "tcp://127.0.0.1:9"), Source("a", "tcp://127.0.0.1:10")])
    sub.stop_engine("a")
    assert sub.subscribed("a|b") and not sub.subscribed("a")


async def test_a_subscription_that_cannot_start_is_not_reported_subscribed(
    sub: KVEventSubscriber,
) -> None:
    sub.start([Source("e1", "tcp://127.0.0.1:not-a-port")])
    await wait_until(lambda: not sub.subscribed("e1"))
    assert sub.errors == 1


async def test_two_dp_ranks_through_resolve_sources(
    ctx: zmq.asyncio.Context,
    make_pub: Callable[..., Publisher],
    sub: KVEventSubscriber,
    collector: Collector,
) -> None:
    for _ in range(20):  # two adjacent free ports, as one engine's ranks 0 and 1 take
        r0 = make_pub(rank=0)
        try:
            r1 = make_pub(rank=1, port=r0.port + 1)
            break
        except zmq.ZMQError:
            continue
    else:
        pytest.skip("no two adjacent free ports")
    # what GET /kv_event_sources answers when the ranks report the configured endpoint
    # (the offset is then applied by the router), with each rank's replay socket
    config = {
        "0": vllm_source(f"tcp://*:{r0.port}", replay_endpoint=r0.replay_endpoint),
        "1": vllm_source(f"tcp://*:{r0.port}", replay_endpoint=r0.replay_endpoint),
    }
    sources = resolve_sources("e1", "127.0.0.1", config)
    assert [s.endpoint for s in sources] == [r0.endpoint, r1.endpoint]
    sub.start(sources)
    await r0.wait_subscribed()
    await r1.wait_subscribed()
    await r0.send(stored([1]))
    await r1.send(stored([2]))
    await r1.send(stored([3]))
    await collector.wait(3)
    assert sorted(h for _, d in collector.got for h in d.stored) == [1, 2, 3]
    assert sub._seq == {("e1", 0): 0, ("e1", 1): 1}


async def test_malformed_messages_are_counted_and_the_subscription_lives_on(
    make_pub: Callable[..., Publisher], sub: KVEventSubscriber, collector: Collector
) -> None:
    pub = make_pub(replay=False)
    await subscribe(sub, ("e1", pub))
    await pub.send(stored([1]))  # seq 0
    await collector.wait(1)
    await pub.pub.send_multipart([b"", b"\x00" * 8])  # no payload frame... 2 frames: decoded
    await pub.pub.send_multipart([b"", b"\x00\x01", payload(stored([2]))])  # short seq
    await pub.pub.send_multipart([b"", b"x", b"y", b"z"])  # 4 frames
    await pub.send_raw(b"\xc1garbage")  # seq 1: undecodable, so its events are lost
    await pub.send_raw(msgspec.msgpack.encode([1.0, 5, 0]))  # seq 2
    await pub.send(stored([3]))  # seq 3
    await collector.wait(3)
    assert sub.errors == 5
    # the lost batches show as a gap on the next good one, which resets the engine
    assert collector.got[1:] == [
        ("e1", CacheDelta(cleared=True, lost=True)),
        ("e1", CacheDelta([3])),
    ]
    assert (sub.gaps, sub.resets) == (1, 1)


async def test_a_failing_listener_does_not_end_the_subscription(
    make_pub: Callable[..., Publisher],
) -> None:
    got: list[CacheDelta] = []

    def listener(engine: str, delta: CacheDelta) -> None:
        got.append(delta)
        if len(got) == 1:
            raise RuntimeError("policy bug")

    sub = KVEventSubscriber(listener, catch_up=False)
    try:
        pub = make_pub()
        await subscribe(sub, ("e1", pub))
        await pub.send(stored([1]))
        await pub.send(stored([2]))
        await wait_until(lambda: len(got) == 2)
        assert sub.errors == 1 and sub.subscribed("e1")
    finally:
        await sub.aclose()


@pytest.mark.parametrize("hwm", [4, 100_000])
async def test_what_a_busy_gateway_buffers_is_bounded_by_the_hwm(hwm: int) -> None:
    """While the event loop is stuck, ZMQ's I/O thread keeps receiving into a queue of at
    most ``hwm`` batches; beyond it the publisher is pushed back (vLLM's PUB then drops,
    which the subscriber sees as a gap). The publisher here does not drop (XPUB_NODROP),
    so what it managed to send while the gateway was busy is what was buffered in transit."""
    busy, done = threading.Event(), threading.Event()
    got: list[CacheDelta] = []

    def listener(engine: str, delta: CacheDelta) -> None:
        got.append(delta)
        if len(got) == 1:
            busy.set()
            done.wait(5.0)  # the event loop is stuck until the publisher gives up

    burst = 1500
    sub = KVEventSubscriber(listener, hwm=hwm, catch_up=False)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # a plain (thread) publisher: it must run while the loop cannot
    try:
        pub.setsockopt(zmq.SNDHWM, 4)
        pub.setsockopt(zmq.XPUB_NODROP, 1)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        sub.start([Source("e1", f"tcp://127.0.0.1:{port}")])
        assert await asyncio.to_thread(pub.poll, 5000)  # the subscription came
        assert pub.recv()[:1] == b"\x01"
        pad = "x" * 65536  # 64 KiB batches: the kernel's socket buffers hold few of them
        big = payload(Stored([1], None, [], 16, None, "GPU", pad))

        def publish_burst() -> int:
            pub.send_multipart([b"", (0).to_bytes(8, "big"), payload(stored([0]))])
            assert busy.wait(5.0)
            sent, stalled_since = 0, None
            while sent < burst:
                try:
                    pub.send_multipart([b"", (sent + 1).to_bytes(8, "big"), big], zmq.NOBLOCK)
                    sent, stalled_since = sent + 1, None
                except zmq.Again:
                    stalled_since = stalled_since or time.monotonic()
                    if time.monotonic() - stalled_since > 0.2:
                        break  # nobody takes more
                    time.sleep(0.001)
            done.set()
            return sent

        sent = await asyncio.to_thread(publish_burst)
        await wait_until(lambda: len(got) == sent + 1)
        assert sub.gaps == 0 and sub.errors == 0
        if hwm == 4:
            assert sent < burst // 2, sent
        else:
            assert sent == burst
        assert len(sub._seq) == 1  # one integer per (engine, rank), however many batches
    finally:
        done.set()
        await sub.aclose()
        pub.close(linger=0)
        ctx.term()


async def test_aclose_ends_everything(
    make_pub: Callable[..., Publisher], collector: Collector
) -> None:
    sub = KVEventSubscriber(collector)
    pub = make_pub()
    await subscribe(sub, ("e1", pub), ("e2", make_pub()))
    sub.stop_engine("e2")  # still being cancelled when aclose runs
    tasks = [*sub._tasks.values(), *sub._stopping]
    await sub.aclose()
    assert all(t.done() for t in tasks)
    assert not sub.subscribed("e1")


# -- catch-up: a subscriber that starts late rebuilds the engine's state from its replay buffer
async def test_a_late_subscriber_catches_up_from_the_replay_buffer(
    make_pub: Callable[..., Publisher], collector: Collector
) -> None:
    """Batches published before the subscription are replayed from seq 0; live batches the
    replay already delivered are skipped, later ones continue the sequence (no reset)."""
    pub = make_pub(topic=b"kv")
    for i in range(3):  # nobody listens yet: lost live, kept in the replay buffer
        await pub.send(stored([i]), drop=True)
    sub = KVEventSubscriber(collector, replay_timeout_s=0.5)
    try:
        sub.start([pub.source("e1")])
        await pub.wait_subscribed()
        await collector.wait(3)
        assert pub.replay_requests[:1] == [0]
        await pub.send_raw(payload(stored([1])), seq=2)  # a live copy of a replayed batch
        await pub.send(stored([3]))  # seq 3: next in sequence
        await collector.wait(4)
        await quiet()
        assert [d.stored for d in collector.of("e1")] == [[0], [1], [2], [3]]
        assert (sub.replayed, sub.resets, sub.gaps) == (3, 0, 0)
    finally:
        await sub.aclose()


async def start_on_an_empty_buffer(sub: KVEventSubscriber, pub: Publisher) -> None:
    """Subscribe ``sub`` to ``pub`` as engine e1 and wait until its catch-up found nothing."""
    sub.start([pub.source("e1")])
    await wait_until(lambda: pub.replay_requests == [0])
    await asyncio.sleep(0.05)


async def test_batches_lost_to_the_slow_joiner_with_nothing_after_them_are_replayed(
    make_pub: Callable[..., Publisher], collector: Collector
) -> None:
    """The catch-up found an empty buffer, then the engine published its last batches before
    the subscription reached it (ZMQ's slow joiner): no later batch reveals the gap, so the
    subscriber asks the replay socket again while it has received nothing live."""
    pub = make_pub()
    sub = KVEventSubscriber(collector, replay_timeout_s=0.5)
    try:
        await start_on_an_empty_buffer(sub, pub)
        await pub.send(stored([1]), drop=True)
        await pub.send(stored([2]), drop=True)
        await collector.wait(2)
        await pub.send(stored([3]), drop=True)
        await collector.wait(3)  # asked again from seq 2
        assert [d.stored for d in collector.of("e1")] == [[1], [2], [3]]
        assert pub.replay_requests[-1] == 2 and (sub.resets, sub.gaps) == (0, 0)
        await pub.wait_subscribed()
        await pub.send(stored([4]))  # live at last: in sequence
        await collector.wait(4)
        assert sub.replayed == 3  # it came live: the subscriber listens, not asks
    finally:
        await sub.aclose()


async def test_batches_lost_to_the_slow_joiner_before_the_first_live_one_are_replayed(
    make_pub: Callable[..., Publisher], collector: Collector
) -> None:
    """The catch-up found an empty buffer, the engine's first batches went out before the
    subscription reached it, and a live batch came before the first join check: the
    subscriber knows the sequence began at 0, so the live batch reveals the gap."""
    pub = make_pub()
    sub = KVEventSubscriber(collector, replay_timeout_s=0.5)
    try:
        await start_on_an_empty_buffer(sub, pub)
        await pub.send(stored([1]), drop=True)  # lost to the slow joiner
        await pub.send(stored([2]), drop=True)
        await pub.wait_subscribed()
        await pub.send(stored([3]))  # live, before the first join check (0.5 s)
        await collector.wait(3)  # without the gap, never: the join checks end at a live batch
        assert [d.stored for d in collector.of("e1")] == [[1], [2], [3]]
        assert pub.replay_requests == [0, 0] and (sub.gaps, sub.resets) == (1, 0)
    finally:
        await sub.aclose()


async def test_catch_up_from_a_buffer_that_lost_its_oldest_batches(
    make_pub: Callable[..., Publisher], collector: Collector
) -> None:
    """A buffer that no longer holds seq 0 replays what it has; nothing is reset."""
    pub = make_pub(buffer_steps=2)
    for i in range(4):
        await pub.send(stored([i]), drop=True)
    sub = KVEventSubscriber(collector, replay_timeout_s=0.5)
    try:
        sub.start([pub.source("e1")])
        await collector.wait(2)
        await quiet()
        assert [d.stored for d in collector.of("e1")] == [[2], [3]]
        assert sub.resets == 0
    finally:
        await sub.aclose()


async def test_a_mute_replay_socket_delays_but_does_not_stop_the_subscription(
    make_pub: Callable[..., Publisher], collector: Collector
) -> None:
    pub = make_pub()
    pub.replay_mode = "mute"
    sub = KVEventSubscriber(collector, replay_timeout_s=0.2)
    try:
        sub.start([pub.source("e1")])
        await pub.wait_subscribed()
        await asyncio.sleep(0.3)  # past the catch-up timeout
        await pub.send(stored([7]))
        await collector.wait(1)
        assert collector.of("e1")[0].stored == [7]
    finally:
        await sub.aclose()
