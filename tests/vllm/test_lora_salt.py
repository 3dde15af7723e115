"""LoRA adapters and cache salts on real vLLM: kvgate keys them as the engines do.

Two LoRA engines (``lora_fleet``: base model + two tiny adapters built offline, KV events,
render endpoints, runtime adapter loading). The tests prove, against the engines' own
output: the block ids kvgate computes for salted and LoRA requests (every route's
tokenization) are the ids the engine's KV events publish; through kvgate, expected hit
tokens on a mix of base, 2 adapters and 3 salts agree with the engines' prefix-cache hits
within 10 %; an adapter loaded at run time becomes routable within one models refresh.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from conftest import (
    ADAPTERS,
    BLOCK,
    LORA_DIR,
    MODEL,
    RUNTIME_ADAPTER,
    Engine,
    Gateway,
    start_gateway,
)

from gateway.cluster.model_list import parse_model_list
from gateway.cluster.registry import EngineRegistry
from gateway.core.vllm_hash import LoraKey, event_extra_keys
from gateway.proxy.token_keys import TokenKeyer
from tests.promtext import sample_sum

pytestmark = pytest.mark.vllm

SYSTEM = "You route requests to the engine that holds their prefix in its cache. " * 24
MODELS_REFRESH_S = 2.0
"""The gateway's ``health.models_refresh_s`` here (default 5 s)."""


class EventTap:
    """A subscriber to one engine's KV events, ready once it has seen one of its own probes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{engine.events_port}")
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def stored(self, timeout_s: float) -> list[dict[str, Any]]:
        """BlockStored events arriving within ``timeout_s`` of quiet."""
        out: list[dict[str, Any]] = []
        while self.poller.poll(int(timeout_s * 1000)):
            _, _, payload = self.sock.recv_multipart()
            out += [e for e in msgspec.msgpack.decode(payload)[1] if e.get("type") == "BlockStored"]
        return out

    def wait_ready(self) -> None:
        """Send one-block probes until the subscription delivers one (a PUB socket drops
        what it publishes before the subscription reaches it)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            probe = {"model": MODEL, "prompt": f"probe {uuid.uuid4().hex} " * 8, "max_tokens": 1}
            assert httpx.post(self.engine.url + "/v1/completions", json=probe, timeout=60)
            if self.stored(1.0):
                return
        raise AssertionError("no KV events from the engine")

    def blocks_of(self, tokens: list[int], timeout_s: float = 10) -> list[dict[str, Any]]:
        """The events storing ``tokens``' full blocks, in prompt order (matched by their
        token ids: a late event of an earlier request is not taken for this one's)."""
        n = len(tokens) // BLOCK
        found: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while sum(len(e["block_hashes"]) for e in found.values()) < n:
            assert time.monotonic() < deadline, f"{len(found)} events of {n} blocks"
            for e in self.stored(0.5):
                start = starts_at(tokens, e["token_ids"])
                if start is not None:
                    found[start] = e
        return [found[k] for k in sorted(found)]


def starts_at(tokens: list[int], chunk: list[int]) -> int | None:
    """The block-aligned offset of ``chunk`` in ``tokens``, or None."""
    for k in range(0, len(tokens) - len(chunk) + 1, BLOCK):
        if tokens[k : k + len(chunk)] == chunk:
            return k
    return None


def engine_tokens(engine: Engine, route: str, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids as the engine itself gives them (``/tokenize`` or render)."""
    if route in ("messages", "responses"):
        r = httpx.post(f"{engine.url}/v1/{route}/render", json=body, timeout=30)
        assert r.status_code == 200, r.text
        ids: list[int] = r.json()["token_ids"]
        return ids
    query: dict[str, Any] = {"model": body["model"]}
    if route == "chat":
        query.update(messages=body["messages"], add_generation_prompt=True)
    else:
        query["prompt"] = body["prompt"]
    tokens: list[int] = httpx.post(engine.url + "/tokenize", json=query, timeout=30).json()[
        "tokens"
    ]
    return tokens


def registry_of(engine: Engine) -> EngineRegistry:
    """A registry holding ``engine`` with the models and adapters its /v1/models lists."""
    registry = EngineRegistry()
    state = registry.add(engine.url, model=MODEL)
    listed = parse_model_list(httpx.get(engine.url + "/v1/models", timeout=10).json())
    state.models, state.lora = listed.models, dict(listed.lora)
    return registry


async def token_keys(
    registry: EngineRegistry, route: str, body: dict[str, Any], model: str
) -> tuple[tuple[int, ...], int] | None:
    async with httpx.AsyncClient() as client:
        return await TokenKeyer(client, registry).key(route, body, model, BLOCK)


# (route, engine path, model, cache_salt): every tokenization path, salted and not
CASES = [
    ("completions", "/v1/completions", MODEL, "tenant-1"),
    ("chat", "/v1/chat/completions", ADAPTERS[0], None),
    ("chat", "/v1/chat/completions", ADAPTERS[1], "tenant-2"),
    ("messages", "/v1/messages", ADAPTERS[1], "tenant-3"),
    ("responses", "/v1/responses", ADAPTERS[0], "tenant-1"),
]


def body_for(route: str, model: str, salt: str | None, tag: str) -> dict[str, Any]:
    text = f"{tag} {SYSTEM}"
    body: dict[str, Any]
    if route == "completions":
        body = {"prompt": text, "max_tokens": 1}
    elif route in ("chat", "messages"):
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    else:
        body = {"input": text, "max_output_tokens": 16, "store": False}
    body["model"] = model
    if salt is not None:
        body["cache_salt"] = salt
    return body


def test_kvgates_block_ids_for_salted_and_lora_requests_are_the_engines(
    lora_fleet: list[Engine],
) -> None:
    """For each route, adapter and salt: TokenKeyer's keys (the engine's tokens, its
    adapter's name and root, the salt) equal the block ids the engine's KV events publish,
    and the events' lora_name and untagged extra_keys are what vllm_hash says they are."""
    engine = lora_fleet[0]
    registry = registry_of(engine)
    assert set(ADAPTERS) <= set(registry.all()[0].lora)
    tap = EventTap(engine)
    try:
        tap.wait_ready()
        for route, path, model, salt in CASES:
            body = body_for(route, model, salt, uuid.uuid4().hex)

            got = asyncio.run(token_keys(registry, route, body, model))
            assert got is not None, (route, model, salt)
            ids, n_tokens = got
            assert len(ids) == n_tokens // BLOCK >= 3, (route, n_tokens)
            tokens = engine_tokens(engine, route, body)
            assert len(tokens) == n_tokens, (route, model, salt)
            r = httpx.post(engine.url + path, json=body, timeout=60)
            assert r.status_code == 200, r.text
            events = tap.blocks_of(tokens)
            stored = [h for e in events for h in e["block_hashes"]]
            assert stored[: len(ids)] == list(ids), (route, model, salt)
            adapter = registry.lora_adapter(model)
            lora = LoraKey(adapter.name, adapter.path) if adapter else None
            assert {e.get("lora_name") for e in events} == {lora.name if lora else None}
            published = [k for e in events for k in e.get("extra_keys") or []]
            expected = event_extra_keys(len(ids), lora=lora, cache_salt=salt) or []
            assert published[: len(ids)] == [None if k is None else list(k) for k in expected]
    finally:
        tap.close()


@pytest.fixture(scope="module")
def gateway(
    lora_fleet: list[Engine], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    args: list[str] = []
    for e in lora_fleet:
        args += ["--engine", e.url]
    env = {"KVGATE_HEALTH__MODELS_REFRESH_S": str(MODELS_REFRESH_S)}
    gw = start_gateway(tmp_path_factory.mktemp("gw-lora"), args, env=env)
    try:
        yield gw
    finally:
        gw.stop()


def send_partition_mix(gateway: Gateway, engines: list[Engine]) -> dict[str, float]:
    """Base + 2 adapters x (no salt + 3 salts), one identical prompt, each partition sent
    twice through ``gateway``: vLLM shares nothing across partitions, so only second sends
    can hit. Returns the counters' increments: kvgate's expected hit and routed prompt
    tokens, the engines' prefix-cache hits and queries (tokens)."""
    tag = uuid.uuid4().hex

    def counters() -> dict[str, float]:
        text = httpx.get(gateway.url + "/metrics", timeout=10).text
        return {
            "expected": sample_sum(text, "kvgate_routed_expected_hit_tokens_total"),
            "routed": sample_sum(text, "kvgate_routed_prompt_tokens_total"),
            "hits": sum(e.metric("vllm:prefix_cache_hits_total") for e in engines),
            "queries": sum(e.metric("vllm:prefix_cache_queries_total") for e in engines),
        }

    before = counters()
    for _ in range(2):
        for model in [MODEL, *ADAPTERS]:
            for salt in [None, "s-1", "s-2", "s-3"]:
                body = body_for("chat", model, salt, tag)
                r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
    after = counters()
    out = {k: after[k] - before[k] for k in after}
    prompt_tokens = int(r.json()["usage"]["prompt_tokens"])
    # the 12 second sends hit (all but the last, recomputed, token's block); first sends never
    assert out["hits"] >= 12 * (prompt_tokens - BLOCK) * 0.9, out
    assert out["hits"] <= 12 * prompt_tokens, out
    return out


def test_expected_hits_on_adapters_and_salts_agree_with_the_engines_text_keys(
    lora_fleet: list[Engine], gateway: Gateway
) -> None:
    """Default (text) keys estimate tokens from characters, so compare rates: kvgate's
    expected hit share of the prompt tokens it routed against the engines' hit share of
    their queries, within 10 % (keys blind to salt or adapter would expect hits on 11 of
    the 12 first sends too: about twice the engines' share)."""
    out = send_partition_mix(gateway, lora_fleet)
    kvgate_rate = out["expected"] / out["routed"]
    engine_rate = out["hits"] / out["queries"]
    assert abs(kvgate_rate - engine_rate) <= 0.10 * engine_rate, out


def test_expected_hits_on_adapters_and_salts_agree_with_the_engines_token_keys(
    lora_fleet: list[Engine], tmp_path: Path
) -> None:
    """Token keys and KV events (precise mode): kvgate's expected hit tokens themselves
    agree with the engines' prefix-cache hits within 10 %."""
    args: list[str] = []
    for e in lora_fleet:
        args += ["--engine", e.url]
    env = {"KVGATE_KEYING": "tokens", "KVGATE_KV_EVENTS": "true"}
    gw = start_gateway(tmp_path, args, env=env)
    try:
        out = send_partition_mix(gw, lora_fleet)
        text = httpx.get(gw.url + "/metrics", timeout=10).text
    finally:
        gw.stop()
    assert sample_sum(text, "kvgate_routing_keys_total", mode="tokens") >= 24, out
    assert abs(out["expected"] - out["hits"]) <= 0.10 * out["hits"], out


def test_an_adapter_loaded_at_runtime_is_routable_within_one_refresh(
    lora_fleet: list[Engine], gateway: Gateway
) -> None:
    """``/v1/load_lora_adapter`` on one engine: kvgate lists the adapter within one models
    refresh (plus a monitor round) and routes it to that engine only."""
    target = lora_fleet[1]

    def listed() -> set[str]:
        return {m["id"] for m in httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"]}

    assert RUNTIME_ADAPTER not in listed()
    load = {"lora_name": RUNTIME_ADAPTER, "lora_path": str(LORA_DIR / RUNTIME_ADAPTER)}
    r = httpx.post(target.url + "/v1/load_lora_adapter", json=load, timeout=60)
    assert r.status_code == 200, r.text
    loaded = time.monotonic()
    while RUNTIME_ADAPTER not in listed():
        assert time.monotonic() - loaded < MODELS_REFRESH_S + 3, "not listed after a refresh"
        time.sleep(0.1)
    try:
        for i in range(3):
            body = body_for("completions", RUNTIME_ADAPTER, None, f"runtime {i}")
            r = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvgate-engine"] == target.url
            assert r.json()["model"] == RUNTIME_ADAPTER
    finally:
        httpx.post(
            target.url + "/v1/unload_lora_adapter", json={"lora_name": RUNTIME_ADAPTER}, timeout=60
        )
