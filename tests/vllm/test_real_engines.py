"""kvgate in front of real vLLM engines (CPU build, tiny model): the ``vllm`` tier."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from conftest import ADAPTERS, BLOCK, MODEL, Fleet, Gateway, start_gateway
from openai import OpenAI

from gateway.core.vllm_hash import block_ids
from tests.promtext import sample_sum

pytestmark = pytest.mark.vllm

SYSTEM = "You route requests to the engine that holds their prefix in its cache. " * 12


@pytest.fixture(scope="module")
def gateway(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    args = ["--policy", "cache_aware"]
    for e in fleet.unified:
        args += ["--engine", e.url]
    gw = start_gateway(tmp_path_factory.mktemp("gw"), args)
    try:
        yield gw
    finally:
        gw.stop()


def client(gw: Gateway) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_chat_and_completions_stream_and_not(gateway: Gateway) -> None:
    oa = client(gateway)
    msgs = [{"role": "user", "content": "Say something about caches."}]
    r = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8)  # type: ignore[arg-type]
    assert r.choices[0].message.content is not None and r.usage is not None
    chunks = list(
        oa.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=8,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    c = oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert c.choices[0].text is not None
    pieces = list(
        oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True)
    )
    assert sum(1 for p in pieces if p.choices and p.choices[0].text) >= 1


def test_prefix_affinity_is_proven_by_the_engines_own_counters(
    fleet: Fleet, gateway: Gateway
) -> None:
    oa = client(gateway)
    before = {e.url: e.metric("vllm:prefix_cache_hits_total") for e in fleet.unified}
    engines = []
    for i in range(4):
        raw = oa.chat.completions.with_raw_response.create(
            model=MODEL,
            max_tokens=2,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"question {i}"},
            ],
        )
        engines.append(raw.headers["x-kvgate-engine"])
    assert len(set(engines)) == 1
    after = {e.url: e.metric("vllm:prefix_cache_hits_total") for e in fleet.unified}
    chosen = engines[0]
    other = next(u for u in after if u != chosen)
    assert after[chosen] - before[chosen] >= 3 * 8 * BLOCK  # three repeats of >= 8 blocks
    assert after[other] == before[other]


def test_the_scraper_reads_real_metrics_and_cache_config(gateway: Gateway) -> None:
    engines = httpx.get(gateway.url + "/admin/engines").json()["engines"]
    for e in engines:
        m = e["metrics"]
        assert m is not None and m["block_size"] == BLOCK
        assert m["num_gpu_blocks"] and m["num_gpu_blocks"] > 0
        assert e["health"] == "healthy" and e["models"] == [MODEL, *ADAPTERS]
    # While a long request runs on an engine, the gateway's scraped numbers show it (values,
    # not family names: prometheus_client prints every registered family).
    body = {
        "model": MODEL,
        "prompt": SYSTEM * 2,  # ~300 tokens: with the answer, inside max_model_len 2048
        "max_tokens": 1600,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        engine = r.headers["x-kvgate-engine"]
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream (a disconnect)
        next(lines)
        deadline = time.monotonic() + 3  # the request decodes for 4+ s; scrapes are 1 s apart
        while True:
            text = httpx.get(gateway.url + "/metrics").text
            kv = sample_sum(text, "kvgate_engine_kv_cache_usage_ratio", engine=engine)
            running = sample_sum(text, "kvgate_engine_running_requests", engine=engine)
            if (kv > 0 and running == 1) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert kv > 0 and running == 1, (kv, running)


def test_token_keys_equal_the_engines_kv_event_ids_bit_for_bit(fleet: Fleet) -> None:
    engine = fleet.unified[0]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"tcp://127.0.0.1:{engine.events_port}")
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    stored: list[int] = []

    def receive(until: float) -> None:
        """The BlockStored ids published until ``until`` (monotonic), in order."""
        while time.monotonic() < until and poller.poll(100):
            _, _, payload = sock.recv_multipart()
            for event in msgspec.msgpack.decode(payload)[1]:
                if event.get("type") == "BlockStored":
                    stored.extend(event["block_hashes"])

    def complete(prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        assert httpx.post(engine.url + "/v1/completions", json=body, timeout=60).is_success

    # The subscription is up once a probe's blocks arrive (a SUB socket drops what is
    # published before it joins): one unique 2-block probe per try until one does.
    deadline = time.monotonic() + 60
    while not stored:
        assert time.monotonic() < deadline, "no KV event reached the subscriber in 60 s"
        complete(f"probe {time.time()} " + "subscription probe " * 12)
        receive(time.monotonic() + 1)
    prompt = f"unique prompt {time.time()} " + "tokens for hashing " * 40
    tokens = httpx.post(engine.url + "/tokenize", json={"model": MODEL, "prompt": prompt}).json()[
        "tokens"
    ]
    mine = list(block_ids(tokens, BLOCK))
    assert len(mine) == len(tokens) // BLOCK >= 8
    complete(prompt)

    def published() -> list[int]:  # the ids published from where the prompt's first one is
        return stored[stored.index(mine[0]) :][: len(mine)] if mine[0] in stored else []

    deadline = time.monotonic() + 30
    while len(published()) < len(mine) and time.monotonic() < deadline:
        receive(deadline)
    sock.close(linger=0)
    ctx.term()
    assert published() == mine


def test_pd_through_nixl_is_proven_by_the_decode_engine(fleet: Fleet, tmp_path: Path) -> None:
    gw = start_gateway(
        tmp_path,
        ["--policy", "round_robin", "--prefill", fleet.prefill.url, "--decode", fleet.decode.url],
        env={"KVGATE_PD__MIN_UNCACHED_TOKENS": "0"},  # always disaggregate
    )
    try:
        before = fleet.decode.metric(
            "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        oa = client(gw)
        r = oa.completions.create(
            model=MODEL,
            prompt=SYSTEM + " and decode it elsewhere",
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )
        assert r.usage is not None and r.usage.completion_tokens == 12
        stream = oa.chat.completions.create(
            model=MODEL,
            max_tokens=6,
            stream=True,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        after = fleet.decode.metric(
            "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        prompt_tokens = r.usage.prompt_tokens
        text = httpx.get(gw.url + "/metrics").text
        pd_lines = [ln for ln in text.splitlines() if "pd_requests_total{" in ln]
        assert after - before >= (prompt_tokens - 1) // BLOCK * BLOCK, pd_lines  # KV over NIXL
        assert 'kvgate_pd_requests_total{mode="remote"} 2.0' in text
    finally:
        gw.stop()


def held_blocks(policy: object, engines: list[str]) -> dict[str, set[int]]:
    """The blocks a policy believes each engine holds (Preble's tree and announced blocks, or
    a prefix index)."""
    held: dict[str, set[int]] = {u: set() for u in engines}
    tree = getattr(policy, "tree", None)
    if tree is not None:  # Preble: its tree, and the blocks engines announced (both count)
        for node in tree.nodes():
            for url, n in node.engines.items():
                held[url].update(node.blocks[:n])
        for url in engines:
            held[url].update(policy.announced.blocks(url))  # type: ignore[attr-defined]
    else:
        for url in engines:
            held[url] = set(policy.index.blocks(url))  # type: ignore[attr-defined]
    return held


class Published:
    """What an independent subscriber saw one engine publish: the blocks it holds, the blocks
    it removed, the last batch's sequence number and the sequence number of each block's
    store (and of the last AllBlocksCleared, key -1)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.blocks: set[int] = set()
        self.removed = 0
        self.seq = -1
        self.stored_at: dict[int, int] = {}

    async def until(self, done: Any, timeout: float = 60, what: str = "") -> None:
        """Apply published batches until ``done()`` holds (fails after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"not published within {timeout:.0f} s: {what}"
            if not await self.sock.poll(100):
                continue
            _, seq, payload = await self.sock.recv_multipart()
            self.seq = int.from_bytes(seq, "big", signed=True)
            for event in msgspec.msgpack.decode(payload)[1]:
                kind = event.get("type")
                if kind == "BlockStored":
                    self.blocks.update(event["block_hashes"])
                    self.stored_at.update(dict.fromkeys(event["block_hashes"], self.seq))
                elif kind == "BlockRemoved":
                    self.blocks.difference_update(event["block_hashes"])
                    self.removed += len(event["block_hashes"])
                elif kind == "AllBlocksCleared":
                    self.blocks.clear()
                    self.stored_at[-1] = self.seq


@pytest.mark.parametrize(
    ("policy", "options", "kv_events"),
    [
        ("preble", {}, True),
        ("cache_aware", {"precise": "true"}, True),
        ("weighted_scorer", {"precise": "true"}, True),
        ("cache_aware", {}, False),  # no events: the same checks must fail
    ],
)
def test_kv_events_make_the_prefix_state_exact(
    fleet: Fleet, policy: str, options: dict[str, str], kv_events: bool
) -> None:
    """In-process gateway (so the policy can be inspected) with token keys, in front of the
    small engine (100 KV blocks): 12 requests over 6 prompts of ~29 blocks each, with
    40-token answers (blocks holding output tokens are cached too), overflow its cache.
    With KV events, the blocks the policy attributes to the engine are exactly the blocks
    the engine holds, as an independent subscriber saw it store and evict them (compared
    whole: a block the policy missed, or kept after an eviction, fails); a cleared cache
    (/reset_prefix_cache) empties the policy's entry. Without events the policy still
    attributes blocks after the reset, so the check fails: it can."""
    import uuid

    import zmq.asyncio

    from gateway.config import load_settings
    from gateway.proxy.app import create_app

    engine = fleet.small
    settings = load_settings(
        engines=[{"url": engine.url}],
        policy={"name": policy, "options": options},
        keying="tokens",
        kv_events=kv_events,
        log_requests=False,
    )
    app = create_app(settings)
    tag = uuid.uuid4().hex  # fresh prompts: nothing of them is cached yet

    async def reset(client: httpx.AsyncClient, seen: Published, timeout: float = 60) -> None:
        """Clear the engine's cache; returns once ``seen`` got the AllBlocksCleared."""
        before = seen.stored_at.get(-1, -1)
        assert (await client.post("/reset_prefix_cache")).status_code == 200
        # a probe shorter than a block: the step vLLM publishes AllBlocksCleared with
        probe = {"model": MODEL, "prompt": "reset probe", "max_tokens": 2}
        assert (await client.post("/v1/completions", json=probe)).status_code == 200
        cleared = lambda: seen.stored_at.get(-1, -1) > before  # noqa: E731
        await seen.until(cleared, timeout, what="AllBlocksCleared")

    def gateway_seq(state: Any) -> int:
        """The last batch the gateway's subscriber took from the engine (-1 without events)."""
        if state.kv_events is None:
            return -1
        return max((q for (e, _), q in state.kv_events._seq.items() if e == engine.url), default=-1)

    async def synced(state: Any, seq: int) -> None:
        """Wait until the gateway's subscriber took batch ``seq`` (at once without events)."""
        deadline = time.monotonic() + 30
        while kv_events and gateway_seq(state) < seq:
            assert time.monotonic() < deadline, f"gateway at batch {gateway_seq(state)} < {seq}"
            await asyncio.sleep(0.05)  # polling the condition above, not a fixed wait

    async def scenario() -> tuple[set[int], set[int], int, set[int], int, set[int]]:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(f"tcp://127.0.0.1:{engine.events_port}")
        seen = Published(sock)
        live = seen.blocks
        async with httpx.AsyncClient(base_url=engine.url, timeout=60) as direct:
            # earlier tests' blocks leave the engine; a SUB socket drops what is published
            # before it joins, so reset until this subscriber sees the clear
            for _ in range(30):
                try:
                    await reset(direct, seen, timeout=2)
                    break
                except AssertionError:
                    continue
            else:
                pytest.fail("the subscriber never saw a cache reset")
            removed_before = seen.removed
            async with app.router.lifespan_context(app):
                state = app.state.gateway  # started: engines checked, buffered events replayed
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(
                    transport=transport, base_url="http://gw", timeout=120
                ) as gw:
                    assert (await gw.get("/ready")).status_code == 200
                    for i in range(12):
                        body = {
                            "model": MODEL,
                            "max_tokens": 40,  # answers fill blocks too: those count as well
                            "ignore_eos": True,
                            "messages": [
                                {"role": "system", "content": f"{tag} {i % 6} " + SYSTEM * 6},
                                {"role": "user", "content": f"q{i}"},
                            ],
                        }
                        r = await gw.post("/v1/chat/completions", json=body)
                        assert r.status_code == 200, r.text
                # A marker after the requests: once this subscriber and the gateway's have
                # its batch, they have every batch before it (published in order).
                marker = f"{tag} marker " + SYSTEM
                tokens = await direct.post("/tokenize", json={"model": MODEL, "prompt": marker})
                last = block_ids(tokens.json()["tokens"], BLOCK)[-1]
                body = {"model": MODEL, "prompt": marker, "max_tokens": 1}
                assert (await direct.post("/v1/completions", json=body)).status_code == 200
                await seen.until(lambda: last in seen.stored_at, what="the marker's blocks")
                await synced(state, seen.stored_at[last])
                removed = seen.removed - removed_before
                live_before = set(live)
                held = held_blocks(state.dispatcher.policy, [engine.url])[engine.url]
                await reset(direct, seen)
                await synced(state, seen.stored_at[-1])
                after_reset = held_blocks(state.dispatcher.policy, [engine.url])[engine.url]
                live_after = set(live)
                batches = state.kv_events.batches if state.kv_events is not None else 0
        sock.close(linger=0)
        ctx.term()
        return held, live_before, removed, after_reset, batches, live_after

    held, live, removed, after_reset, batches, live_after = asyncio.run(scenario())
    if not kv_events:
        assert held != live or after_reset, "without events the policy cannot follow"
        return
    assert batches > 0
    assert removed > 0, "the scenario did not evict anything"
    assert len(held) >= 60  # the cache (100 blocks) is mostly the last prompts
    assert held == live, (len(held - live), len(live - held))
    assert after_reset == live_after == set()


def test_every_vllm_series_in_dashboards_and_alerts_is_exported(fleet: Fleet) -> None:
    """Each ``vllm:*`` name the Grafana dashboards and Prometheus alerts query is on a real
    engine's /metrics (NIXL series on the P/D engines, after the P/D test's transfers)."""
    import re

    root = Path(__file__).resolve().parents[2]
    sources = [*(root / "deploy" / "grafana" / "dashboards").glob("*.json")]
    sources.append(root / "deploy" / "prometheus" / "alerts.yml")
    used = {m for src in sources for m in re.findall(r"vllm:[a-z_]+", src.read_text())}
    exported: set[str] = set()
    for engine in [*fleet.unified, fleet.prefill, fleet.decode]:
        text = httpx.get(engine.url + "/metrics", timeout=10).text
        exported.update(re.findall(r"^(vllm:[a-z_]+)", text, re.M))  # samples
        exported.update(re.findall(r"^# TYPE (vllm:[a-z_]+)", text, re.M))  # families
    assert used, "no vllm:* series found in the dashboards"
    missing = sorted(used - exported)
    nixl = sorted(n for n in exported if "nixl" in n)
    assert not missing, f"queried but not exported by vLLM 0.32: {missing}; NIXL ones: {nixl}"
