"""The emulator's KV events: vLLM's wire format and block ids, read by the gateway's subscriber.

The ids are checked against :func:`gateway.core.vllm_hash.block_ids` of the tokens the
emulator's ``/tokenize`` returns (the hash whose golden vectors come from vLLM itself,
tests/core/test_vllm_hash.py); batches are read raw from the replay socket (no ZMQ
slow-joiner race) and live through :class:`~gateway.cluster.kv_events.KVEventSubscriber`
found via ``GET /kv_event_sources``, as the gateway finds them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from fastapi import FastAPI

from gateway.cli.emulate import register, settings_from_args
from gateway.cluster.kv_events import CacheDelta, KVEventSubscriber, resolve_sources
from gateway.core.errors import ConfigError
from gateway.core.vllm_hash import block_ids
from gateway.emulator import EmulatorSettings
from gateway.emulator.kv_publisher import END_SEQ, KVEventsConfig
from tests.emulator.conftest import running_app, state_of, wait_for

EVENTS = KVEventsConfig(
    endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="kv"
)
BLOCKS = 24  # a tiny KV pool, so that a few prompts evict
SETTINGS = EmulatorSettings(
    time_scale=0.01, max_model_len=2048, kv_capacity_blocks=BLOCKS, kv_events=EVENTS
)


def prompt(i: int, blocks: int = 6) -> str:
    # 4 characters per token, 16 tokens per block, plus BOS: blocks full blocks
    return f"{i:04d}" + "x" * (64 * blocks - 4)


@pytest.fixture
async def api() -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    async with running_app(SETTINGS) as pair:
        yield pair


async def tokens(client: httpx.AsyncClient, text: str) -> list[int]:
    r = await client.post("/tokenize", json={"prompt": text})
    ids: list[int] = r.json()["tokens"]
    return ids


async def complete(client: httpx.AsyncClient, text: str) -> None:
    r = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
    assert r.status_code == 200, r.text


async def replayed(endpoint: str, start: int = 0) -> list[tuple[bytes, int, list[Any]]]:
    """Every batch the replay socket still buffers from ``start``: (topic, seq, events)."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    await sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        frames = await asyncio.wait_for(sock.recv_multipart(), 5)
        assert frames[0] == b"" and len(frames) == 4, frames
        _, topic, seq, payload = frames
        if seq == END_SEQ:
            break
        batch = msgspec.msgpack.decode(payload)
        assert isinstance(batch, list) and len(batch) == 3 and batch[2] == 0  # [ts, events, rank]
        out.append((topic, int.from_bytes(seq, "big"), batch[1]))
    sock.close(linger=0)
    ctx.term()
    return out


async def test_kv_event_sources_resolve_to_the_bound_sockets(
    api: tuple[FastAPI, httpx.AsyncClient],
) -> None:
    _, client = api
    config = (await client.get("/kv_event_sources")).json()
    [src] = resolve_sources("e", "127.0.0.1", config)
    assert src.endpoint.startswith("tcp://127.0.0.1:") and not src.endpoint.endswith(":0")
    assert src.replay is not None and src.replay != src.endpoint and src.topic == b"kv"
    info = (await client.get("/metrics")).text
    assert 'prefix_caching_hash_algo="sha256"' in info  # what a token keyer reproduces


async def test_stored_blocks_carry_vllm_ids_tokens_and_parents(
    api: tuple[FastAPI, httpx.AsyncClient],
) -> None:
    app, client = api
    text = prompt(1)
    ids = block_ids(await tokens(client, text), 16)
    await complete(client, text)
    await complete(client, text)  # a prefix hit: nothing new is stored
    batches = await replayed(state_of(app).kv_events.replay_endpoint)  # type: ignore[union-attr,arg-type]
    assert [seq for _, seq, _ in batches] == list(range(len(batches)))
    assert {topic for topic, _, _ in batches} == {b"kv"}
    events = [e for _, _, evs in batches for e in evs]
    assert all(e["type"] == "BlockStored" for e in events), events
    stored = [h for e in events for h in e["block_hashes"]]
    # The last block: the engine caches blocks before the prompt's final token only.
    assert stored == list(ids[: (len(await tokens(client, text)) - 1) // 16])
    first = events[0]
    assert first["parent_block_hash"] is None and first["block_size"] == 16
    assert first["medium"] == "GPU" and len(first["token_ids"]) == 16 * len(first["block_hashes"])
    assert first["token_ids"] == (await tokens(client, text))[: len(first["token_ids"])]
    for before, after in itertools.pairwise(events):  # chained across steps
        assert after["parent_block_hash"] == before["block_hashes"][-1]


async def test_evictions_and_a_reset_are_announced(api: tuple[FastAPI, httpx.AsyncClient]) -> None:
    app, client = api
    for i in range(6):  # 6 x 6 cacheable blocks > 24: the oldest are evicted
        await complete(client, prompt(i))
    publisher = state_of(app).kv_events
    assert publisher is not None
    events = [e for _, _, evs in await replayed(publisher.replay_endpoint or "") for e in evs]
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed and all(
        len(e["block_hashes"]) == 1 for e in events if e["type"] == "BlockRemoved"
    )
    held: set[int] = set()
    for e in events:  # replaying the events gives exactly what the pool caches
        if e["type"] == "BlockStored":
            held.update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            held.difference_update(e["block_hashes"])
    pool = state_of(app).driver.core.pool
    assert len(held) == pool.cached <= BLOCKS
    first = block_ids(await tokens(client, prompt(0)), 16)[0]
    assert first in removed and first not in held
    assert (await client.post("/reset_prefix_cache")).status_code == 200
    last = (await replayed(publisher.replay_endpoint or ""))[-1][2]
    assert last == [{"type": "AllBlocksCleared"}] and pool.cached == 0


async def test_the_gateway_subscriber_mirrors_the_engine_cache(
    api: tuple[FastAPI, httpx.AsyncClient],
) -> None:
    """Live: the gateway's subscriber, found through /kv_event_sources, ends with the pool's
    exact block set (after evictions), and empties on a reset."""
    app, client = api
    held: set[int] = set()
    deltas: list[CacheDelta] = []

    def listener(engine: str, delta: CacheDelta) -> None:
        deltas.append(delta)
        if delta.cleared:
            held.clear()
        held.update(delta.stored)
        held.difference_update(delta.removed)

    sub = KVEventSubscriber(listener)
    sub.start(resolve_sources("e", "127.0.0.1", (await client.get("/kv_event_sources")).json()))
    try:
        for i in range(6):
            await complete(client, prompt(i))
        publisher = state_of(app).kv_events
        assert publisher is not None
        # the subscriber's thread may join late and replay the first batches (ZMQ's slow
        # joiner); on a loaded 2-core CI machine that took longer than 3 s once
        await wait_for(lambda: sub.batches >= publisher.seq, timeout=15.0)
        want = {h for i in range(6) for h in block_ids(await tokens(client, prompt(i)), 16)}
        assert held <= want and len(held) == state_of(app).driver.core.pool.cached
        assert any(d.removed for d in deltas)
        await client.post("/reset_prefix_cache")
        await wait_for(lambda: sub.batches >= publisher.seq, timeout=15.0)
        assert not held and deltas[-1].cleared
    finally:
        await sub.aclose()


def test_the_cli_takes_vllms_kv_events_config() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    cfg = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "topic": "t"}
    args = parser.parse_args(
        ["emulate", "--kv-events-config", json.dumps(cfg), "--prefix-caching-hash-algo",
         "sha256_cbor"]
    )  # fmt: skip
    events = settings_from_args(args).kv_events
    assert events is not None and events.topic == "t" and events.hash_algo == "sha256_cbor"
    off = parser.parse_args(["emulate", "--kv-events-config", '{"enable_kv_cache_events":false}'])
    assert settings_from_args(off).kv_events is None
    for bad in ("[1]", "{not json", '{"enable_kv_cache_events":true,"bogus":1}'):
        with pytest.raises(ConfigError):
            settings_from_args(parser.parse_args(["emulate", "--kv-events-config", bad]))
