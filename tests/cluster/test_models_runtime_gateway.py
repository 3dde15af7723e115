"""Through the gateway: a LoRA adapter loaded on an engine after start is routable within one
models refresh interval, and an engine answering 404 for a model gets its list re-read."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fake_kube import wait_until

from gateway.config import load_settings
from gateway.proxy.app import create_app
from gateway.proxy.deps import GatewayState
from tests.promtext import sample_sum

URL = "http://e:1"
BASE = "llama"


@dataclass
class LoraEngine:
    """Answers like vLLM with --enable-lora: adapters come and go at runtime."""

    adapters: dict[str, str] = field(default_factory=dict)
    served: list[str] = field(default_factory=list)
    asked: list[str] = field(default_factory=list)
    running: str = ""
    """Adapters vLLM's vllm:lora_requests_info reports running (comma-joined)."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            cards: list[dict[str, Any]] = [{"id": BASE, "root": "/m", "parent": None}]
            cards += [{"id": n, "root": p, "parent": BASE} for n, p in self.adapters.items()]
            return httpx.Response(200, json={"object": "list", "data": cards})
        if path == "/metrics":
            lora = f'max_lora="2",running_lora_adapters="{self.running}",waiting_lora_adapters=""'
            text = f"vllm:num_requests_running 0\nvllm:lora_requests_info{{{lora}}} 1.7e9\n"
            return httpx.Response(200, text=text)
        model = json.loads(request.content)["model"]
        self.asked.append(model)
        if model != BASE and model not in self.adapters:  # vLLM's answer for an unknown model
            error = {"message": f"The model `{model}` does not exist.", "type": "NotFoundError"}
            return httpx.Response(404, json={"error": {**error, "param": "model", "code": 404}})
        self.served.append(model)
        return httpx.Response(
            200,
            json={
                "id": "cmpl-1",
                "object": "chat.completion",
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            },
        )


@asynccontextmanager
async def gateway(
    engine: LoraEngine, refresh_s: float, **others: LoraEngine
) -> AsyncIterator[tuple[httpx.AsyncClient, GatewayState]]:
    engines = {URL: engine, **others}

    async def route(request: httpx.Request) -> httpx.Response:
        return await engines[f"http://{request.url.netloc.decode()}"].handle(request)

    cfg = load_settings(
        engines=[{"url": url} for url in engines],
        policy={"name": "least_loaded"},
        health={"interval_s": 0.05, "models_refresh_s": refresh_s},
        retries={"max_attempts": 1, "backoff_s": 0.0},
        log_requests=False,
    )
    app = create_app(cfg, transport=httpx.MockTransport(route))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client, app.state.gateway


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def listed(gw: httpx.AsyncClient) -> list[str]:
    return [m["id"] for m in (await gw.get("/v1/models")).json()["data"]]


async def test_an_adapter_loaded_at_runtime_is_routable_within_one_refresh() -> None:
    engine = LoraEngine()
    refresh_s = 0.2
    async with gateway(engine, refresh_s) as (gw, state):
        assert state.monitor.models_refresh_s == refresh_s  # health.models_refresh_s is used
        assert (await gw.post("/v1/chat/completions", json=chat("sql"))).status_code == 404
        assert engine.asked == []  # kvgate's own 404: no engine lists it
        engine.adapters["sql"] = "/adapters/sql"  # POST /v1/load_lora_adapter on the engine
        # one interval plus a monitor round, with slack for a loaded machine
        await wait_until(lambda: "sql" in state.registry.models(), timeout=10 * refresh_s)
        assert await listed(gw) == [BASE, "sql"]
        r = await gw.post("/v1/chat/completions", json=chat("sql"))
        assert r.status_code == 200, r.text
        assert engine.served == ["sql"]
        text = (await gw.get("/metrics")).text
        assert sample_sum(text, "kvgate_engine_lora_adapters", engine=URL) == 1.0
        assert sample_sum(text, "kvgate_engine_model_refreshes_total", outcome="ok") >= 2


async def test_a_404_from_the_engine_re_reads_its_models() -> None:
    engine = LoraEngine(adapters={"sql": "/adapters/sql"})
    async with gateway(engine, refresh_s=3600.0) as (gw, state):  # no periodic re-read here
        assert await listed(gw) == [BASE, "sql"]
        del engine.adapters["sql"]  # POST /v1/unload_lora_adapter on the engine
        r = await gw.post("/v1/chat/completions", json=chat("sql"))
        assert r.status_code == 404  # the engine's own answer, relayed
        assert engine.asked == ["sql"]
        # well before any periodic re-read (3600 s here, 5 s by default)
        await wait_until(lambda: "sql" not in state.registry.models(), 2.0, "the re-read")
        assert await listed(gw) == [BASE]
        r = await gw.post("/v1/chat/completions", json=chat("sql"))
        assert r.status_code == 404 and engine.asked == ["sql"]  # not forwarded again
        assert (await gw.post("/v1/chat/completions", json=chat(BASE))).status_code == 200


async def test_lora_requests_go_to_the_engine_where_the_adapter_is_resident() -> None:
    idle = LoraEngine(adapters={"sql": "/adapters/sql"})
    resident = LoraEngine(adapters={"sql": "/adapters/sql"}, running="sql")
    async with gateway(idle, 3600.0, **{"http://r:1": resident}) as (gw, state):
        (view,) = [v for v in state.registry.view({}).engines if v.id == "http://r:1"]
        assert view.lora_resident == frozenset({"sql"}) and view.max_lora == 2
        for _ in range(4):  # least_loaded alone alternates between the two idle engines
            r = await gw.post("/v1/chat/completions", json=chat("sql"))
            assert r.headers["x-kvgate-engine"] == "http://r:1"
        engines = set()
        for _ in range(4):
            r = await gw.post("/v1/chat/completions", json=chat(BASE))
            engines.add(r.headers["x-kvgate-engine"])
        assert engines == {URL, "http://r:1"}
        assert (len(idle.served), len(resident.served)) == (2, 6)
