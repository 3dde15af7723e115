"""In-process fake vLLM engines behind an httpx.MockTransport, with fault switches."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{model}"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{model}"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",model_name="{model}"}} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{engine="0",model_name="{model}"}} 40.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="{block_size}",num_gpu_blocks="1000"}} 1.0
"""


@dataclass
class FakeEngine:
    """One engine: answers like vLLM, or fails as told."""

    url: str
    model: str = "m"
    mode: str = "ok"  # ok | refuse | status503 | status500 | status400 | midstream | hang_health
    waiting: int = 0
    block_size: int = 16
    delay: float = 0.0
    seen: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if self.mode == "refuse":
            raise httpx.ConnectError("refused", request=request)
        if path == "/health":
            return httpx.Response(503 if self.mode == "hang_health" else 200)
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": self.model}]})
        if path == "/metrics":
            return httpx.Response(
                200,
                text=METRICS.format(
                    model=self.model, running=1, waiting=self.waiting, block_size=self.block_size
                ),
            )
        body = json.loads(request.content)
        if self.delay:
            await asyncio.sleep(self.delay)
        self.seen.append(body)
        self.raw.append(request.content)
        self.headers.append(dict(request.headers))
        if self.mode.startswith("status"):
            code = int(self.mode[6:])
            return httpx.Response(
                code,
                json={
                    "error": {"message": f"fake {code}", "type": "X", "param": None, "code": code}
                },
            )
        rid = request.headers.get("x-request-id", "none")
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode") and self.mode != "no_params":
            return httpx.Response(
                200,
                json={
                    "id": f"cmpl-{rid}",
                    "object": "text_completion",
                    "model": self.model,
                    "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
                    "kv_transfer_params": {
                        "do_remote_prefill": True,
                        "do_remote_decode": False,
                        "remote_engine_id": self.url,
                        "remote_block_ids": [1, 2],
                        "remote_request_id": rid,
                    },
                },
            )
        if body.get("stream"):
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, content=self._sse(rid)
            )
        return httpx.Response(
            200,
            json={
                "id": f"cmpl-{rid}",
                "object": "text_completion",
                "model": self.model,
                "choices": [
                    {"index": 0, "text": f"hello from {self.url}", "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            },
        )

    async def _sse(self, rid: str) -> AsyncIterator[bytes]:
        for i in range(3):
            chunk = {"id": f"cmpl-{rid}", "choices": [{"index": 0, "text": f"t{i} "}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            if self.mode == "midstream" and i == 1:
                raise httpx.ReadError("engine died")
        usage = {
            "id": f"cmpl-{rid}",
            "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        }
        yield f"data: {json.dumps(usage)}\n\n".encode()
        yield b"data: [DONE]\n\n"


class FakeCluster:
    """Routes requests to fake engines by base URL."""

    def __init__(self, *engines: FakeEngine) -> None:
        self.engines = {e.url: e for e in engines}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.netloc.decode()}"
        engine = self.engines.get(base)
        if engine is None:
            raise httpx.ConnectError("no such host", request=request)
        return await engine.handle(request)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)
