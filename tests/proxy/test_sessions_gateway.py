"""Sessions end to end: the gateway in front of emulated engines keeps a session's turns on
one engine although its shared prefix has spread to every engine, and counts what it did."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx

from gateway.config import load_settings
from gateway.emulator import EmulatorSettings, create_emulator_app
from gateway.proxy.app import create_app
from tests.promtext import sample_sum

ENGINES = ("http://e0:8000", "http://e1:8000", "http://e2:8000")
MODEL = "kvgate-emulated"
SYSTEM = "You are the release assistant of the storage team; answer briefly. " * 12


class Hosts(httpx.AsyncBaseTransport):
    """Each engine URL's requests to its own in-process emulator."""

    def __init__(self, apps: dict[str, httpx.ASGITransport]) -> None:
        self.apps = apps

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.apps[f"http://{request.url.netloc.decode()}"].handle_async_request(
            request
        )


@asynccontextmanager
async def gateway(**settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with AsyncExitStack() as stack:
        apps = {}
        for i, url in enumerate(ENGINES):
            app = create_emulator_app(EmulatorSettings(time_scale=0.01, engine_index=str(i)))
            await stack.enter_async_context(app.router.lifespan_context(app))
            apps[url] = httpx.ASGITransport(app=app)
        cfg = load_settings(
            engines=[{"url": u, "model": MODEL} for u in ENGINES],
            policy={"name": "round_robin"},  # a policy that moves every request along
            log_requests=False,
            **settings,
        )
        gw = create_app(cfg, transport=Hosts(apps))
        await stack.enter_async_context(gw.router.lifespan_context(gw))
        transport = httpx.ASGITransport(app=gw, client=("127.0.0.1", 5000))
        yield await stack.enter_async_context(
            httpx.AsyncClient(transport=transport, base_url="http://gw")
        )


def chat(*turns: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}


async def send(gw: httpx.AsyncClient, body: dict[str, Any], **headers: str) -> tuple[str, int]:
    """(engine, prompt tokens the engine had cached) of one request."""
    r = await gw.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return r.headers["x-kvgate-engine"], int(details.get("cached_tokens") or 0)


FIRST = "Which of the nightly jobs failed, and on which cluster did it run? " * 6
SECOND = "And the one before it, was it the same disk that filled up that night? " * 6


async def conversation(gw: httpx.AsyncClient, **who: str) -> list[tuple[str, int]]:
    """Spread the system prompt to every engine, then two turns of one session with
    other traffic in between."""
    user = who.pop("user", None)
    extra = {"user": user} if user else {}
    for i in range(len(ENGINES)):  # round robin: the shared prefix lands on every engine
        await send(gw, chat(f"warm-up question {i} " * 8))
    one = await send(gw, chat(FIRST, **extra), **who)
    await send(gw, chat("an unrelated question " * 8))
    two = await send(gw, chat(FIRST, "It was the backup job.", SECOND, **extra), **who)
    return [one, two]


async def test_a_session_stays_on_its_engine_after_its_prefix_spread() -> None:
    async with gateway() as gw:
        (e1, _), (e2, cached) = await conversation(gw, **{"x-claude-code-session-id": "c-1"})
        assert e2 == e1
        assert cached > len(SYSTEM) // 4  # more than the spread prefix: the first turn too
        (b1, _), (b2, _) = await conversation(gw, user="alice")  # the body's user field
        assert b2 == b1
        metrics = (await gw.get("/metrics")).text
    assert sample_sum(metrics, "kvgate_session_affinity_total", outcome="bound") == 2
    assert sample_sum(metrics, "kvgate_session_affinity_total", outcome="new") == 2
    assert sample_sum(metrics, "kvgate_session_bindings") == 2


async def test_without_sessions_the_policy_moves_the_second_turn() -> None:
    async with gateway(sessions={"enabled": False}) as gw:
        (e1, _), (e2, cached) = await conversation(gw, **{"x-claude-code-session-id": "c-1"})
        metrics = (await gw.get("/metrics")).text
    assert e2 != e1 and cached <= len(SYSTEM) // 4 + 16
    assert "kvgate_session_affinity_total" not in metrics
