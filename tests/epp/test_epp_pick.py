"""``kvgate epp`` picks: the answer's header and metadata, fallbacks, the subset hint, kvgate's
refusals as ImmediateResponses, P/D's prefiller header, and the body sent back in
FULL_DUPLEX_STREAMED mode, each in both body modes where the mode matters."""

from __future__ import annotations

import asyncio

import pytest

from gateway.epp import EppOptions
from tests.epp.harness import MODEL, FakeEnvoy, fleet, picker

MODES = ["buffered", "duplex"]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there " * 40}]}


@pytest.mark.parametrize("mode", MODES)
async def test_the_pick_is_the_header_and_the_metadata_with_fallbacks(mode: str) -> None:
    options = EppOptions(port=0, metrics_port=None, fallbacks=2)
    async with (
        fleet("both", "both", "both") as (transport, urls),
        picker(
            transport,
            [{"url": u} for u in urls],
            options=options,
            policy={"name": "round_robin"},
        ) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        hosts = {u.removeprefix("http://") for u in urls}
        primaries = []
        for _ in range(3):
            out = await envoy.send("/v1/chat/completions", {**CHAT, "max_tokens": 2}, mode=mode)
            assert out.status == 200 and out.json()["choices"]
            assert out.destination == out.metadata  # one value in both places
            names = out.destination.split(",")
            assert len(names) == 3 and set(names) == hosts  # primary, then two fallbacks
            assert out.set_headers["x-request-id"]
            primaries.append(names[0])
        assert len(set(primaries)) == 3  # round robin: the policy decides the primary
        await envoy.aclose()


async def test_by_default_the_pick_is_one_address() -> None:
    async with (
        fleet("both", "both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls]) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        out = await envoy.send("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert out.destination == out.metadata and "," not in out.destination
        await envoy.aclose()


@pytest.mark.parametrize("mode", MODES)
async def test_the_subset_hint_is_honoured(mode: str) -> None:
    async with (
        fleet("both", "both", "both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls], policy={"name": "round_robin"}) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        allowed = ["10.0.0.2:8000", "10.0.0.9:8000"]  # one kvgate knows, one it does not
        for _ in range(4):
            out = await envoy.send("/v1/chat/completions", CHAT, mode=mode, subset=allowed)
            assert out.destination == "10.0.0.2:8000" == out.metadata
        out = await envoy.send("/v1/chat/completions", CHAT, mode=mode, subset=["10.0.0.9:8000"])
        assert out.immediate_status == 503
        assert "subset" in out.immediate_body["error"]["message"]
        out = await envoy.send("/v1/chat/completions", CHAT, mode=mode, subset=[])
        assert out.immediate_status == 503  # an empty list: nothing is eligible
        assert not server.ledger.open and not server.service.dispatcher.in_flight
        await envoy.aclose()


@pytest.mark.parametrize("mode", MODES)
async def test_refusals_are_immediate_responses_in_the_apis_shape(mode: str) -> None:
    health = {"cooldown_s": 600, "cooldown_max_s": 600}  # a lost engine stays out
    async with (
        fleet("both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls], health=health) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        out = await envoy.send("/v1/chat/completions", b"{not json", mode=mode)
        assert out.immediate_status == 400 and out.immediate_body["error"]["type"]
        out = await envoy.send("/v1/messages", {"model": MODEL, "max_tokens": 1}, mode=mode)
        assert out.immediate_status == 400 and out.immediate_body["type"] == "error"  # Anthropic
        out = await envoy.send("/v1/chat/completions", {**CHAT, "model": "nope"}, mode=mode)
        assert out.immediate_status == 404
        transport.down.add("10.0.0.1:8000")
        for _ in range(2):  # failure_threshold probes: the engine is out, nothing eligible
            await server.service.monitor.check_all()
        out = await envoy.send("/v1/chat/completions", CHAT, mode=mode)
        assert out.immediate_status == 503
        assert set(out.immediate_body["error"]) == {"message", "type", "param", "code"}
        assert not server.ledger.open and not server.service.dispatcher.in_flight
        await envoy.aclose()


async def test_a_shed_request_is_answered_429_and_a_held_one_leaves_with_its_stream() -> None:
    policy = {"name": "dualmap", "options": {"dispatch_pending_tokens": 10}}
    async with (
        fleet("both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls], policy=policy, max_queued=1) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        queues = server.service.dispatcher.queues
        long = {"model": MODEL, "prompt": "blocker " * 500, "max_tokens": 1}
        first = await envoy.send("/v1/completions", long, respond=False)  # pending prefill
        assert first.destination
        held = asyncio.create_task(
            envoy.send("/v1/completions", {"model": MODEL, "prompt": "held " * 50})
        )
        while not len(queues):
            await asyncio.sleep(0.01)
        out = await envoy.send("/v1/completions", {"model": MODEL, "prompt": "third " * 50})
        assert out.immediate_status == 429
        assert out.immediate_body["error"]["type"] == "rate_limit_error"
        held.cancel()  # Envoy drops the held request's stream
        with pytest.raises(asyncio.CancelledError):
            await held
        while len(queues):
            await asyncio.sleep(0.01)
        first.call.cancel()
        await envoy.aclose()


@pytest.mark.parametrize("mode", MODES)
async def test_pd_pool_names_the_prefill_engine_for_the_sidecar(mode: str) -> None:
    engines = [
        {"url": "http://10.0.0.1:8000", "role": "prefill"},
        {"url": "http://10.0.0.2:8000", "role": "decode"},
    ]
    long = {"model": MODEL, "prompt": "a long shared document " * 400, "max_tokens": 1}
    async with fleet("prefill", "decode") as (transport, _), picker(transport, engines) as server:
        envoy = FakeEnvoy(server, transport)
        spoof = {"x-prefiller-host-port": "169.254.169.254:80"}
        out = await envoy.send("/v1/completions", long, mode=mode, headers=spoof, respond=False)
        assert out.destination.split(",")[0] == "10.0.0.2:8000"  # the decode engine
        assert out.set_headers["x-prefiller-host-port"] == "10.0.0.1:8000"
        assert "10.0.0.1:8000" not in out.destination  # a prefill engine never decodes
        out.call.cancel()
        short = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        out = await envoy.send("/v1/completions", short, mode=mode, headers=spoof, respond=False)
        if "x-prefiller-host-port" not in out.set_headers:  # a local prefill: the client's goes
            assert "x-prefiller-host-port" in out.removed
        out.call.cancel()
        await envoy.aclose()


async def test_a_duplex_body_goes_back_unchanged_in_streamed_mutations() -> None:
    async with (
        fleet("both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls]) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        big = {"model": MODEL, "prompt": "x" * 200_000 + " end", "max_tokens": 1}
        raw = __import__("json").dumps(big).encode()
        out = await envoy.send("/v1/completions", raw, mode="duplex", chunk=8192)
        assert out.echoed == raw and out.status == 200
        await envoy.aclose()


async def test_client_keys_are_checked_and_never_reach_the_engine() -> None:
    async with (
        fleet("both", "both") as (transport, urls),
        picker(
            transport,
            [{"url": urls[0], "api_key": "engine-secret"}, {"url": urls[1]}],
            api_keys=["client-key"],
            policy={"name": "round_robin"},
        ) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        out = await envoy.send("/v1/completions", body, respond=False)
        assert out.immediate_status == 401  # no client key
        seen = set()
        for _ in range(2):
            auth = {"authorization": "Bearer client-key"}
            out = await envoy.send("/v1/completions", body, headers=auth, respond=False)
            out.call.cancel()
            if out.destination == urls[0].removeprefix("http://"):
                assert out.set_headers["authorization"] == "Bearer engine-secret"
            else:
                assert "authorization" in out.removed and "authorization" not in out.set_headers
            seen.add(out.destination)
        assert len(seen) == 2
        await envoy.aclose()
