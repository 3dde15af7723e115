"""Replay a request schedule against any OpenAI-compatible endpoint; TTFT and E2E per request.

Each request is a completion with a given prompt text, sent at its arrival
time (open loop), streamed, with ``max_tokens`` and ``ignore_eos`` so output
lengths are exact. Used by the simulator-fidelity tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    arrival: float
    prompt: str
    output_tokens: int
    session: str | None = None
    """Sent as ``x-session-id`` by the live routing benchmark's client (None: no header)."""


@dataclass(slots=True)
class ReplayResult:
    arrival: float
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    engine: str | None = None
    error: str | None = None


async def _one(
    client: httpx.AsyncClient, url: str, model: str, req: ReplayRequest, start: float
) -> ReplayResult:
    out = ReplayResult(arrival=req.arrival)
    delay = start + req.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    t0 = time.perf_counter()
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            out.engine = resp.headers.get("x-kvgate-engine")
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and out.ttft is None:
                    out.ttft = time.perf_counter() - t0
                usage = chunk.get("usage")
                if usage:
                    out.output_tokens = usage.get("completion_tokens", 0)
        out.e2e = time.perf_counter() - t0
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def replay(
    url: str, model: str, requests: Sequence[ReplayRequest], *, timeout_s: float = 300.0
) -> list[ReplayResult]:
    """Send ``requests`` at their arrival times (seconds from now); wait for all."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        return list(await asyncio.gather(*(_one(client, url, model, r, start) for r in requests)))
