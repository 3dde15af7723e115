"""The live routing benchmark's --sessions: session schemes, and the header the client sends."""

from __future__ import annotations

import json

import httpx
from openai import AsyncOpenAI

from benchmarks.live.client import _one
from benchmarks.live.routing import with_sessions
from benchmarks.live.workloads import SharedPrefixShape, shared_prefix_requests, unique_requests
from gateway.bench.loadgen import ReplayRequest

SHAPE = SharedPrefixShape(system_tokens=40, question_tokens=8)


def test_session_schemes() -> None:
    shared = shared_prefix_requests(SHAPE, 200, 10.0, 0)
    prompt = with_sessions(shared, "prompt", 0)
    assert [r.prompt for r in prompt] == [r.prompt for r in shared]
    for r in prompt:
        assert r.prompt.startswith(f"System prompt {r.session[1:]}.")  # type: ignore[index]
    agents = {r.session for r in with_sessions(shared, "agents", 0)}
    assert len(agents) == 4 * SHAPE.prefixes
    unique = with_sessions(unique_requests(SHAPE, 200, 10.0, 0), "agents", 0)
    assert {r.session for r in unique} == {f"r{i}" for i in range(16)}


async def test_the_client_sends_the_session_header() -> None:
    seen: list[str | None] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("x-session-id"))
        chunk = {"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": 1}}
        body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    http = httpx.AsyncClient(transport=httpx.MockTransport(engine))
    client = AsyncOpenAI(base_url="http://x/v1", api_key="k", http_client=http, max_retries=0)
    async with client:
        for session in ("s-1", None):
            out = await _one(client, "m", ReplayRequest(0.0, "hi", 1, session), 0.0, 1.0)
            assert out.error is None
    assert seen == ["s-1", None]
