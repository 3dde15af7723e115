"""The emulator's HTTP API in-process: vLLM's JSON, SSE framing, errors and /metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from gateway.emulator import EmulatorSettings, create_emulator_app
from tests.emulator.conftest import metrics_of, running_app, state_of

FAST = EmulatorSettings(time_scale=0.01, max_model_len=4096)
LONG_PROMPT = "You are a careful assistant who answers questions about routing. " * 30


@pytest.fixture
async def api() -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    async with running_app(FAST) as pair:
        yield pair


@pytest.fixture
async def client(api: tuple[FastAPI, httpx.AsyncClient]) -> httpx.AsyncClient:
    return api[1]


def sse_events(body: str) -> list[str]:
    """The data payloads of an SSE body, asserting vLLM's exact framing."""
    assert body.endswith("data: [DONE]\n\n")
    frames = body.split("\n\n")
    assert frames[-1] == ""
    payloads = []
    for frame in frames[:-1]:
        assert frame.startswith("data: ") and "\n" not in frame, frame
        payloads.append(frame.removeprefix("data: "))
    assert payloads.count("[DONE]") == 1
    return payloads[:-1]


# -- completions and chat -------------------------------------------------------------


async def test_completion_json_shape(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 7})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "kvgate-emulated"
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert len(choice["text"].split()) == 7
    assert body["usage"] == {
        "prompt_tokens": 4,
        "total_tokens": 11,
        "completion_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_chat_json_shape_and_max_completion_tokens(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 5,
            "ignore_eos": True,
            "temperature": 0.3,
            "some_unknown_field": {"x": 1},
        },
    )
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 5
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize(
    ("headers", "body_id", "expected"),
    [
        ({"X-Request-Id": "from-header"}, "from-body", "cmpl-from-header"),
        ({}, "from-body", "cmpl-from-body"),
    ],
)
async def test_request_id(
    client: httpx.AsyncClient, headers: dict[str, str], body_id: str, expected: str
) -> None:
    r = await client.post(
        "/v1/completions",
        headers=headers,
        json={"prompt": "x", "max_tokens": 1, "request_id": body_id},
    )
    assert r.json()["id"] == expected


async def test_natural_stop_and_ignore_eos(client: httpx.AsyncClient) -> None:
    free = (await client.post("/v1/completions", json={"prompt": "q", "max_tokens": 1000})).json()
    assert free["choices"][0]["finish_reason"] == "stop"
    assert 16 <= free["usage"]["completion_tokens"] <= 256
    forced = await client.post(
        "/v1/completions", json={"prompt": "q", "max_tokens": 300, "ignore_eos": True}
    )
    assert forced.json()["usage"]["completion_tokens"] == 300
    assert forced.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("prompt", [[1, 50, 60, 70], ["text prompt"], [[1, 50, 60, 70]]])
async def test_prompt_forms(client: httpx.AsyncClient, prompt: Any) -> None:
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 4


async def test_same_prompt_same_text(client: httpx.AsyncClient) -> None:
    body = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 500}
    a = (await client.post("/v1/chat/completions", json=body)).json()
    b = (await client.post("/v1/chat/completions", json=body)).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    other = {"messages": [{"role": "user", "content": "tell me more"}], "max_tokens": 500}
    c = (await client.post("/v1/chat/completions", json=other)).json()
    assert c["choices"][0]["message"]["content"] != a["choices"][0]["message"]["content"]


# -- SSE ----------------------------------------------------------------------------------


async def test_completion_stream_framing_and_usage_chunk(client: httpx.AsyncClient) -> None:
    body = {"prompt": "stream me", "max_tokens": 6, "stream": True}
    r = await client.post(
        "/v1/completions", json={**body, "stream_options": {"include_usage": True}}
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = [json.loads(p) for p in sse_events(r.text)]
    *content, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert all(c["object"] == "text_completion" and "usage" not in c for c in content)
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * 5 + ["length"]
    text = "".join(c["choices"][0]["text"] for c in content)
    plain = await client.post("/v1/completions", json={**body, "stream": False})
    assert text == plain.json()["choices"][0]["text"]
    no_usage = await client.post("/v1/completions", json=body)
    assert all(json.loads(p)["choices"] for p in sse_events(no_usage.text))


async def test_chat_stream_starts_with_the_role(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions",
        headers={"X-Request-Id": "abc"},
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    chunks = [json.loads(p) for p in sse_events(r.text)]
    assert {c["id"] for c in chunks} == {"chatcmpl-abc"}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert len(content) == 4 and content[-1]["choices"][0]["finish_reason"] == "length"
    assert [c["usage"]["completion_tokens"] for c in content] == [1, 2, 3, 4]
    assert chunks[-1]["choices"] == []


# -- errors -------------------------------------------------------------------------------

ERRORS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "kvgate-emulated"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [], "model": "other"}, 404, "model"),
    ("/tokenize", {}, 400, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), ERRORS)
async def test_errors_have_vllms_shape(
    client: httpx.AsyncClient, path: str, body: Any, status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


async def test_error_messages_match_vllm(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"})
    assert r.json()["error"]["message"] == (
        "The model `gpt-9` does not exist. Valid aliases: kvgate-emulated."
    )
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5000})
    assert "This model's maximum context length is 4096 tokens" in r.json()["error"]["message"]


# -- other endpoints ------------------------------------------------------------------------


async def test_models_health_version_load(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "kvgate-emulated" and card["max_model_len"] == 4096
    health = await client.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert "version" in (await client.get("/version")).json()
    assert (await client.get("/load")).json() == {"server_load": 0}


async def test_tokenize_matches_usage(client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "count my tokens please"}]
    tok = (await client.post("/tokenize", json={"messages": messages})).json()
    chat = (await client.post("/v1/chat/completions", json={"messages": messages})).json()
    assert tok["count"] == len(tok["tokens"]) == chat["usage"]["prompt_tokens"]
    assert tok["max_model_len"] == 4096
    plain = (await client.post("/tokenize", json={"prompt": "abcdefgh"})).json()
    assert plain["count"] == 3
    raw = await client.post("/tokenize", json={"prompt": "abcd", "add_special_tokens": False})
    assert raw.json()["count"] == 1
    detok = await client.post("/detokenize", json={"tokens": plain["tokens"]})
    assert len(detok.json()["prompt"].split()) == 2


# -- metrics --------------------------------------------------------------------------------


async def test_metrics_parse_and_move(client: httpx.AsyncClient) -> None:
    before = metrics_of((await client.get("/metrics")).text)
    assert before["vllm:prefix_cache_hits_total"] == 0
    assert before["vllm:num_requests_running"] == 0
    assert before["vllm:kv_cache_usage_perc"] == 0
    assert before["vllm:request_success_total|finished_reason=abort"] == 0
    for _ in range(2):
        r = await client.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 5})
        assert r.status_code == 200
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt = r.json()["usage"]["prompt_tokens"]
    assert cached > 0
    after = metrics_of((await client.get("/metrics")).text)
    assert after["vllm:prefix_cache_hits_total"] == cached
    assert after["vllm:prefix_cache_queries_total"] == 2 * prompt
    assert after["vllm:prompt_tokens_total"] == 2 * prompt
    assert after["vllm:generation_tokens_total"] == 10
    assert after["vllm:request_success_total|finished_reason=length"] == 2
    assert after["vllm:time_to_first_token_seconds_count"] == 2
    assert after["vllm:e2e_request_latency_seconds_count"] == 2
    assert after["vllm:inter_token_latency_seconds_count"] == 8
    assert after["vllm:num_preemptions_total"] == 0
    assert after["vllm:prompt_tokens_by_source_total|source=local_cache_hit"] == cached


async def test_metrics_names_types_and_cache_info(client: httpx.AsyncClient) -> None:
    text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:cache_config_info": "gauge",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
    for name, family in families.items():
        if name.startswith("vllm:") and name != "vllm:cache_config_info":
            for s in family.samples:
                assert s.labels["model_name"] == "kvgate-emulated" and s.labels["engine"] == "0"
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1
    assert info.labels["block_size"] == "16" and info.labels["engine"] == "0"
    assert info.labels["enable_prefix_caching"] == "True"
    assert int(info.labels["num_gpu_blocks"]) > 0
    assert "prefix_caching_hash_algo" in info.labels


async def test_each_app_owns_its_registry() -> None:
    async with running_app(FAST) as (_, a), running_app(FAST) as (_, b):
        await a.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        ma = metrics_of((await a.get("/metrics")).text)
        mb = metrics_of((await b.get("/metrics")).text)
    assert ma["vllm:generation_tokens_total"] == 3
    assert mb["vllm:generation_tokens_total"] == 0


# -- batching and disconnects -------------------------------------------------------------


async def test_concurrent_requests_share_batches() -> None:
    async with running_app(EmulatorSettings(time_scale=0.1)) as (_, client):
        body = {"max_tokens": 100, "ignore_eos": True}
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await client.post("/v1/completions", json={**body, "prompt": "solo"})
        single = loop.time() - t0
        t0 = loop.time()
        replies = await asyncio.gather(
            *(client.post("/v1/completions", json={**body, "prompt": f"p{i}"}) for i in range(8))
        )
        batch = loop.time() - t0
    assert all(r.json()["usage"]["completion_tokens"] == 100 for r in replies)
    assert batch < 3 * single, (single, batch)


async def _call_then_disconnect(app: FastAPI, body: dict[str, Any], after_chunks: int) -> int:
    """Drive the ASGI app directly; the client disconnects after ``after_chunks`` body parts."""
    gone = asyncio.Event()
    sent = False
    parts = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal parts
        if message["type"] == "http.response.body" and message.get("body"):
            parts += 1
            if parts >= after_chunks:
                gone.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"emulator")],
        "client": ("127.0.0.1", 1),
        "server": ("emulator", 80),
        "app": app,
        "state": {},
    }
    if after_chunks == 0:
        asyncio.get_running_loop().call_later(0.05, gone.set)
    await asyncio.wait_for(app(scope, receive, send), 5)
    return parts


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_engine_request(stream: bool) -> None:
    app = create_emulator_app(FAST)
    async with app.router.lifespan_context(app):
        state = state_of(app)
        body = {"prompt": "long job", "max_tokens": 3000, "ignore_eos": True, "stream": stream}
        parts = await _call_then_disconnect(app, body, after_chunks=3 if stream else 0)
        assert parts == 0 if not stream else 3 <= parts < 100, parts  # 3000 if not aborted
        for _ in range(200):
            if state.driver.core.num_running == 0:
                break
            await asyncio.sleep(0.005)
        assert state.driver.core.num_running == 0
        assert state.driver.in_flight == 0
        text = await app_metrics(app)
        assert text["vllm:request_success_total|finished_reason=abort"] == 1
        assert text["vllm:num_requests_running"] == 0


async def app_metrics(app: FastAPI) -> dict[str, float]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://emulator") as client:
        return metrics_of((await client.get("/metrics")).text)
