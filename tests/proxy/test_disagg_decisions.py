"""Visible P/D decisions: the counter by reason and each request's log line (in process)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from gateway.config import load_settings
from gateway.proxy.app import create_app
from tests.promtext import sample_sum
from tests.proxy.fake_engines import FakeCluster, FakeEngine

P0, P1, D0 = "http://p0:8000", "http://p1:8000", "http://d0:8000"
LONG = "a long prompt that is worth a remote prefill " * 60  # ~700 tokens, cold


@asynccontextmanager
async def gateway(*engines: tuple[FakeEngine, str], **settings: Any) -> AsyncIterator[Any]:
    cluster = FakeCluster(*(e for e, _ in engines))
    cfg = load_settings(
        engines=[{"url": e.url, "role": role} for e, role in engines],
        retries={"max_attempts": 3, "backoff_s": 0.0},
        log_requests=True,
        **settings,
    )
    app = create_app(cfg, transport=cluster.transport())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client


async def decisions(gw: httpx.AsyncClient, reason: str) -> float:
    return sample_sum((await gw.get("/metrics")).text, "kvgate_pd_decisions_total", reason=reason)


def done(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == "request done"]


async def test_each_decision_is_counted_and_logged_with_its_prefill_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate")
    p, d = FakeEngine(P0), FakeEngine(D0)
    async with gateway((p, "prefill"), (d, "decode")) as gw:
        assert await decisions(gw, "remote_uncached") == 0
        cold = await gw.post("/v1/completions", json={"model": "m", "prompt": LONG})
        assert await decisions(gw, "remote_uncached") == 1
        tiny = await gw.post("/v1/completions", json={"model": "m", "prompt": "hi there"})
        assert await decisions(gw, "local_short") == 1
    assert cold.status_code == tiny.status_code == 200
    first, second = done(caplog)
    assert (first.prefill, first.pd_reason) == (P0, "remote_uncached")  # type: ignore[attr-defined]
    assert (second.prefill, second.pd_reason) == ("local", "local_short")  # type: ignore[attr-defined]
    assert not hasattr(first, "pd_fallback")


async def test_a_failed_remote_leg_is_logged_as_a_local_fallback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate")
    p, d = FakeEngine(P0, mode="status503"), FakeEngine(D0)
    async with gateway((p, "prefill"), (d, "decode")) as gw:
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": LONG})
    assert r.status_code == 200
    (line,) = done(caplog)
    assert (line.prefill, line.pd_reason, line.pd_fallback) == ("local", "remote_uncached", True)  # type: ignore[attr-defined]


async def test_a_busy_prefill_pool_sends_the_next_request_to_local_prefill() -> None:
    """Both prefill engines hold a leg the router knows about (pending tokens): with a
    wait threshold below their predicted wait, the third request prefills locally."""
    p0, p1 = FakeEngine(P0, delay=0.5), FakeEngine(P1, delay=0.5)
    d = FakeEngine(D0)
    async with gateway(
        (p0, "prefill"), (p1, "prefill"), (d, "decode"), pd={"saturation_wait_s": 0.001}
    ) as gw:

        async def send(i: int) -> int:
            body = {"model": "m", "prompt": f"{i} {LONG}"}
            return (await gw.post("/v1/completions", json=body)).status_code

        first = [asyncio.create_task(send(i)) for i in range(2)]
        async with asyncio.timeout(10):  # both were routed: their prefill legs are running
            while await decisions(gw, "remote_uncached") < 2:
                await asyncio.sleep(0.005)
        assert not p0.seen and not p1.seen  # (the legs take 0.5 s: still in flight)
        assert await send(2) == 200
        assert await asyncio.gather(*first) == [200, 200]
        assert await decisions(gw, "local_saturated") == 1
        assert await decisions(gw, "remote_uncached") == 2
    assert len(p0.seen) == len(p1.seen) == 1  # the two remote legs, one per prefill engine


async def test_a_unified_pool_counts_unified_and_logs_no_pd_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate")
    async with gateway((FakeEngine(D0), "both")) as gw:
        await gw.post("/v1/completions", json={"model": "m", "prompt": LONG})
        assert await decisions(gw, "unified") == 1
    (line,) = done(caplog)
    assert not hasattr(line, "prefill") and not hasattr(line, "pd_reason")
