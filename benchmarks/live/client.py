"""The load side of the live routing benchmark: the official ``openai`` client, async, streamed.

Each request is a ``/v1/completions`` stream sent at its arrival time (open loop), with
``max_tokens`` and vLLM's ``ignore_eos`` so the output length is exact. TTFT is the time to the
first chunk carrying text; a request counts as an error when the call raises, the stream ends
early, or it returns fewer tokens than asked. ``engine`` is kvgate's ``x-kvgate-engine`` header
(which engine served it), absent behind other routers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from openai import AsyncOpenAI

from gateway.bench.loadgen import ReplayRequest, ReplayResult

__all__ = ["ReplayResult", "drive"]


async def _one(
    client: AsyncOpenAI, model: str, req: ReplayRequest, start: float, time_scale: float
) -> ReplayResult:
    out = ReplayResult(arrival=req.arrival)
    delay = start + req.arrival * time_scale - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    t0 = time.perf_counter()
    try:
        raw = await client.completions.with_raw_response.create(
            model=model,
            prompt=req.prompt,
            max_tokens=req.output_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers={"x-session-id": req.session} if req.session else None,
        )
        out.engine = raw.headers.get("x-kvgate-engine")  # kvgate names the engine; others: None
        async for chunk in raw.parse():
            if out.ttft is None and chunk.choices and chunk.choices[0].text:
                out.ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                out.output_tokens = chunk.usage.completion_tokens
        out.e2e = time.perf_counter() - t0
        if out.output_tokens != req.output_tokens:
            out.error = f"{out.output_tokens} of {req.output_tokens} tokens"
    except Exception as exc:  # whatever went wrong, this request failed
        out.error = type(exc).__name__
    return out


async def _drive(
    url: str, model: str, requests: Sequence[ReplayRequest], time_scale: float, timeout_s: float
) -> list[ReplayResult]:
    # the client's own pool: up to 1,000 connections, enough for every request in flight
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout_s)
    async with client:
        start = time.perf_counter()
        jobs = [_one(client, model, r, start, time_scale) for r in requests]
        return list(await asyncio.gather(*jobs))


def drive(
    url: str,
    model: str,
    requests: Sequence[ReplayRequest],
    *,
    time_scale: float = 1.0,
    timeout_s: float = 300.0,
) -> list[ReplayResult]:
    """Send ``requests`` (arrivals in model seconds × ``time_scale``); results in order.

    TTFT and E2E of the results are wall seconds.
    """
    return asyncio.run(_drive(url, model, requests, time_scale, timeout_s))


def warm_up(url: str, model: str) -> None:
    """One tiny request through the router, so that its path works before measuring."""
    results = drive(url, model, [ReplayRequest(0.0, "warm up", 1)], timeout_s=30.0)
    if results[0].error:
        raise RuntimeError(f"warm-up request through {url} failed: {results[0].error}")
