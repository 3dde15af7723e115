"""EventBridge: engines' KV events into a real Dispatcher, with the gateway's metrics.

The engine's HTTP side (``GET /kv_event_sources``) is an httpx.MockTransport; its
publisher is a real ZMQ socket on 127.0.0.1 sending vLLM's wire format
(``[topic, seq, msgpack([ts, events, dp_rank])]``, events as tagged maps).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.cluster.registry import EngineRegistry, EngineState, Health
from gateway.observability import GatewayMetrics
from gateway.policies.cache_aware import CacheAwarePolicy
from gateway.policies.dispatcher import Dispatcher
from gateway.policies.preble import PreblePolicy
from gateway.policies.registry import create_policy
from gateway.proxy.kv_bridge import EventBridge

URL = "http://127.0.0.1:8101"


def stored(*hashes: int) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": None,
        "token_ids": list(range(16 * len(hashes))),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def removed(*hashes: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


CLEARED = {"type": "AllBlocksCleared"}


class Publisher:
    """One vLLM engine's (DP rank 0) KV event publisher, without replay."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.XPUB)  # a PUB that reports subscriptions
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every one, a second subscriber's too
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0

    def sources(self) -> dict[str, Any]:
        """What vLLM's ``GET /kv_event_sources`` answers for it (bound on all interfaces)."""
        return {
            "0": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.port}",
                "replay_endpoint": None,
                "buffer_steps": 10000,
                "hwm": 100000,
                "max_queue_size": 100000,
                "topic": "",
            }
        }

    async def wait_subscribed(self) -> None:
        while (await asyncio.wait_for(self.sock.recv(), 5.0))[:1] != b"\x01":
            pass

    async def send(self, *events: dict[str, Any], skip: int = 0) -> None:
        self.seq += skip  # batches the subscriber never sees
        data = msgspec.msgpack.encode([time.time(), list(events), 0])
        await self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), data])
        self.seq += 1


class Engine:
    """The engine's HTTP side, as an httpx.MockTransport handler."""

    def __init__(self, answer: Any = None, status: int = 200) -> None:
        self.answer, self.status = answer, status
        self.requests: list[httpx.Request] = []
        self.gate: asyncio.Event | None = None  # set: answers wait for it
        self.error: Exception | None = None

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        assert request.url.path == "/kv_event_sources"
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        if isinstance(self.answer, bytes):
            return httpx.Response(self.status, content=self.answer)
        return httpx.Response(self.status, json=self.answer)


class Setup:
    def __init__(self, policy: str, options: dict[str, Any]) -> None:
        self.engine_http = Engine()
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(self.engine_http))
        self.dispatcher = Dispatcher(create_policy(policy, options=options))
        self.metrics = GatewayMetrics()
        self.bridge = EventBridge(self.client, self.dispatcher, self.metrics)
        self.registry = EngineRegistry()
        self.ctx = zmq.asyncio.Context()
        self.publishers: list[Publisher] = []

    def publisher(self) -> Publisher:
        self.publishers.append(Publisher(self.ctx))
        self.engine_http.answer = self.publishers[-1].sources()
        return self.publishers[-1]

    def engine(self, url: str = URL, api_key: str | None = None) -> EngineState:
        state = self.registry.add(url, api_key=api_key)
        state.health = Health.HEALTHY
        return state

    def remove(self, engine: EngineState) -> None:
        """What DELETE /admin/engines and Kubernetes discovery do to a removed engine."""
        self.registry.remove(engine.url)
        engine.retired = True
        self.bridge.subscriber.stop_engine(engine.id)
        self.dispatcher.engine_removed(engine.id)

    def count(self, name: str, engine: str = URL) -> float:
        value = self.metrics.registry.get_sample_value(f"{name}_total", {"engine": engine})
        return value or 0.0

    @property
    def index_blocks(self) -> frozenset[int]:
        policy = self.dispatcher.policy
        assert isinstance(policy, CacheAwarePolicy)
        return policy.index.blocks(URL)

    async def aclose(self) -> None:
        await self.bridge.aclose()
        await self.client.aclose()
        for p in self.publishers:
            p.sock.close(linger=0)
        self.ctx.destroy(linger=0)


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    s = Setup("cache_aware", {"precise": True})
    yield s
    await s.aclose()


@pytest.fixture
async def preble() -> AsyncIterator[Setup]:
    s = Setup("preble", {})
    yield s
    await s.aclose()


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        await asyncio.sleep(0.005)


async def test_events_become_cache_events_and_resets(setup: Setup) -> None:
    pub = setup.publisher()
    engine = setup.engine(api_key="s3cret")
    assert await setup.bridge.attach(engine)
    request = setup.engine_http.requests[0]
    assert str(request.url) == URL + "/kv_event_sources"
    assert request.headers["authorization"] == "Bearer s3cret"
    await pub.wait_subscribed()

    await pub.send(stored(1, 2, 3))
    await wait_until(lambda: setup.index_blocks == {1, 2, 3})
    await pub.send(removed(2), stored(4))
    await wait_until(lambda: setup.index_blocks == {1, 3, 4})
    assert setup.count("kvgate_kv_event_batches") == 2
    assert setup.count("kvgate_kv_event_resets") == 0

    await pub.send(stored(5), CLEARED, stored(6))  # what came after the clear stays
    await wait_until(lambda: setup.count("kvgate_kv_event_batches") == 3)
    assert setup.index_blocks == {6}
    assert setup.count("kvgate_kv_event_resets") == 1

    # lost batches (no replay socket): a reset, but no batch
    await pub.send(stored(7), skip=2)
    await wait_until(lambda: setup.count("kvgate_kv_event_resets") == 2)
    await wait_until(lambda: setup.index_blocks == {7})
    assert setup.count("kvgate_kv_event_batches") == 4
    assert setup.bridge.subscriber.resets == 1


async def test_an_unhealthy_engine_is_forgotten(setup: Setup) -> None:
    pub = setup.publisher()
    engine = setup.engine()
    assert await setup.bridge.attach(engine)
    await pub.wait_subscribed()
    await pub.send(stored(1, 2))
    await wait_until(lambda: setup.index_blocks == {1, 2})
    setup.bridge.on_health(engine, False)
    assert setup.index_blocks == frozenset()
    assert setup.bridge.subscriber.subscribed(URL)  # still listening for its restart
    setup.bridge.on_health(engine, True)  # already subscribed: nothing to fetch
    await asyncio.sleep(0)
    assert len(setup.engine_http.requests) == 1


async def test_preble_marks_an_engine_exact_while_its_events_flow(preble: Setup) -> None:
    pub = preble.publisher()
    engine = preble.engine()
    preble.bridge.on_health(engine, True)  # the monitor's callback attaches it
    await pub.wait_subscribed()
    policy = preble.dispatcher.policy
    assert isinstance(policy, PreblePolicy)
    await pub.send(stored(1))
    await wait_until(lambda: URL in policy.exact)
    preble.bridge.on_health(engine, False)
    assert URL not in policy.exact


@pytest.mark.parametrize(
    "answer,status",
    [
        ({}, 200),  # vLLM without --kv-events-config
        ({"0": {"enable_kv_cache_events": False, "publisher": "null"}}, 200),
        ({"detail": "Not Found"}, 404),  # vLLM 0.30 has no /kv_event_sources
        (b"<html>", 200),
        (["tcp://*:5557"], 200),
        ("error", 0),
    ],
)
async def test_an_engine_without_publishers_is_not_attached(
    setup: Setup, answer: Any, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    if status == 0:
        setup.engine_http.error = httpx.ConnectError("refused")
    else:
        setup.engine_http.answer, setup.engine_http.status = answer, status
    engine = setup.engine()
    with caplog.at_level(logging.WARNING, logger="kvgate.kv_events"):
        assert not await setup.bridge.attach(engine)
    assert "publishes no KV events" in caplog.text
    assert not setup.bridge.subscriber.subscribed(URL)


async def test_detach_then_attach_subscribes_again(setup: Setup) -> None:
    pub = setup.publisher()
    engine = setup.engine()
    assert await setup.bridge.attach(engine)
    await pub.wait_subscribed()
    await pub.send(stored(1))
    await wait_until(lambda: setup.index_blocks == {1})

    setup.bridge.detach(engine.id)
    assert not setup.bridge.subscriber.subscribed(URL)
    assert await setup.bridge.attach(engine)  # a fresh subscription, not a stale "attached"
    assert len(setup.engine_http.requests) == 2
    await pub.wait_subscribed()
    await pub.send(stored(2))
    await wait_until(lambda: setup.index_blocks == {1, 2})
    assert setup.bridge.subscriber.gaps == 0  # its sequence was forgotten with it


async def test_a_removed_and_re_added_engine_resubscribes(setup: Setup) -> None:
    pub = setup.publisher()
    engine = setup.engine()
    setup.bridge.on_health(engine, True)
    await pub.wait_subscribed()
    setup.remove(engine)
    assert not setup.bridge.subscriber.subscribed(URL)

    again = setup.engine()  # the same URL, registered anew
    setup.bridge.on_health(again, True)
    await pub.wait_subscribed()
    await pub.send(stored(9))
    await wait_until(lambda: setup.index_blocks == {9})


async def test_an_engine_removed_while_attaching_stays_unsubscribed(setup: Setup) -> None:
    pub = setup.publisher()
    setup.engine_http.gate = asyncio.Event()
    engine = setup.engine()
    setup.bridge.on_health(engine, True)
    setup.bridge.on_health(engine, True)  # one lookup is enough
    await wait_until(lambda: len(setup.engine_http.requests) == 1)
    setup.remove(engine)  # while GET /kv_event_sources is still on its way
    again = setup.engine()  # and added back before it answers
    setup.bridge.on_health(again, True)
    await wait_until(lambda: len(setup.engine_http.requests) == 2)
    setup.engine_http.gate.set()
    await pub.wait_subscribed()
    await wait_until(lambda: not setup.bridge._pending)
    assert setup.bridge.subscriber.subscribed(URL)
    assert len(setup.bridge.subscriber._tasks) == 1

    # and without a re-add, a removed engine is not subscribed behind its back
    setup.remove(again)
    setup.engine_http.gate = asyncio.Event()
    third = setup.engine()
    setup.bridge.on_health(third, True)
    await wait_until(lambda: len(setup.engine_http.requests) == 3)
    setup.remove(third)
    setup.engine_http.gate.set()
    await wait_until(lambda: not setup.bridge._pending)
    assert not setup.bridge.subscriber.subscribed(URL)


async def test_detach_cancels_a_pending_attach(setup: Setup) -> None:
    setup.publisher()
    setup.engine_http.gate = asyncio.Event()
    engine = setup.engine()
    setup.bridge.on_health(engine, True)
    await wait_until(lambda: len(setup.engine_http.requests) == 1)
    setup.bridge.detach(engine.id)
    await wait_until(lambda: not setup.bridge._pending)
    setup.engine_http.gate.set()
    await asyncio.sleep(0.01)
    assert not setup.bridge.subscriber.subscribed(URL)
