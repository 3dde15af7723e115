"""The response side closes each picked request's accounting as the HTTP proxy does; a request
whose response never ends is released by its stream closing or by the release timer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gateway.epp import EppOptions
from tests.epp.harness import MODEL, FakeEnvoy, fleet, picker
from tests.promtext import sample_sum

MODES = ["buffered", "duplex"]


async def until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def metric(server: object, name: str, **labels: str) -> float:
    from prometheus_client import generate_latest

    text = generate_latest(server.service.metrics.registry).decode()  # type: ignore[attr-defined]
    return sample_sum(text, name, **labels)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True])
async def test_the_response_end_closes_in_flight_hooks_and_metrics(mode: str, stream: bool) -> None:
    async with (
        fleet("both", "both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls]) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        policy = server.service.dispatcher.policy
        finished: list[tuple[str, int]] = []
        hook = policy.on_finished
        policy.on_finished = lambda req, engine, now, ok: (  # type: ignore[method-assign]
            finished.append((engine, req.output_tokens)),
            hook(req, engine, now, ok),
        )
        body = {"model": MODEL, "prompt": "count me " * 30, "max_tokens": 5, "stream": stream}
        if stream:  # the last chunk's usage gives the output length
            body["stream_options"] = {"include_usage": True}
        out = await envoy.send("/v1/completions", body, mode=mode, respond=False)
        engine = "http://" + out.destination.split(",")[0]
        assert server.service.dispatcher.in_flight == {engine: 1}
        assert server.service.registry.get(engine).pending_tokens > 0  # type: ignore[union-attr]
        out.call.cancel()
        await until(lambda: not server.ledger.open, "the cancelled stream's release")
        out = await envoy.send("/v1/completions", body, mode=mode)
        assert out.status == 200 and out.content
        assert server.service.dispatcher.in_flight == {}
        assert not server.ledger.open
        assert all(not e.pending_tokens for e in server.service.registry.all())
        assert finished[-1] == ("http://" + out.destination.split(",")[0], 5)  # usage read
        assert metric(server, "kvgate_requests_total", outcome="ok") == 1
        assert metric(server, "kvgate_requests_total", outcome="cancelled") == 1
        assert metric(server, "kvgate_epp_released_total", reason="stream_closed") == 1
        await envoy.aclose()


async def test_a_response_that_never_comes_is_released_by_the_timer() -> None:
    options = EppOptions(port=0, metrics_port=None, release_after_s=0.2)
    async with (
        fleet("both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls], options=options) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        body = {"model": MODEL, "prompt": "forgotten " * 30, "max_tokens": 1}
        out = await envoy.send("/v1/completions", body, respond=False)  # the stream stays open
        assert server.service.dispatcher.in_flight
        await until(lambda: not server.ledger.open, "the release timer")
        assert server.service.dispatcher.in_flight == {}
        assert all(not e.pending_tokens for e in server.service.registry.all())
        assert metric(server, "kvgate_epp_released_total", reason="timeout") == 1
        assert metric(server, "kvgate_requests_total", outcome="cancelled") == 1
        out.call.cancel()
        await envoy.aclose()


async def test_a_response_served_by_a_fallback_fails_the_primary() -> None:
    options = EppOptions(port=0, metrics_port=None, fallbacks=1)
    async with (
        fleet("both", "both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls], options=options) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        body = {"model": MODEL, "prompt": "retried " * 30, "max_tokens": 2}
        # Envoy could not reach the primary and served on the fallback (as it reports)
        out = await envoy.send("/v1/completions", body, served="fallback")
        primary = "http://" + out.destination.split(",")[0]
        assert out.status == 200
        assert metric(server, "kvgate_engine_errors_total", kind="envoy_fallback") == 1
        assert server.service.dispatcher.in_flight == {}  # primary finished, nothing leaked
        assert server.service.registry.get(primary).consecutive_failures == 1  # type: ignore[union-attr]
        assert not server.ledger.open
        await envoy.aclose()


async def test_stored_responses_bind_to_their_engine_and_pin_follow_ups() -> None:
    async with (
        fleet("both", "both") as (transport, urls),
        picker(transport, [{"url": u} for u in urls], policy={"name": "round_robin"}) as server,
    ):
        envoy = FakeEnvoy(server, transport)
        out = await envoy.send("/v1/responses", {"model": MODEL, "input": "remember me"})
        assert out.status == 200
        response_id = out.json()["id"]
        owner = server.service.responses.owner(response_id)
        assert owner == "http://" + out.destination.split(",")[0]
        for _ in range(3):  # round robin would rotate: the stored response pins its engine
            follow = {"model": MODEL, "input": "and then", "previous_response_id": response_id}
            again = await envoy.send("/v1/responses", follow, mode="duplex")
            assert again.destination == owner.removeprefix("http://")  # no fallbacks
            got = await envoy.send(f"/v1/responses/{response_id}", method="GET")
            assert got.destination == owner.removeprefix("http://") and got.status == 200
        await envoy.aclose()
