"""Every endpoint a vLLM fleet serves, through the gateway, against fake engines: routing
kind, stored responses pinned to their engine, Anthropic-shaped errors, cache salts."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fake_api_engines import FakeApiEngine
from fake_engines import FakeCluster

from gateway.config import load_settings
from gateway.proxy.app import create_app
from gateway.proxy.endpoints import ENDPOINTS, match
from tests.promtext import sample_sum

A, B = "http://a:1", "http://b:1"
RR = {"name": "round_robin"}


@asynccontextmanager
async def gateway(
    *engines: FakeApiEngine, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    cluster = FakeCluster(*engines)
    cfg = load_settings(
        engines=[{"url": e.url} for e in engines],
        retries={"max_attempts": 2, "backoff_s": 0.0},
        log_requests=False,
        **settings,
    )
    app = create_app(cfg, transport=cluster.transport())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client, app.state.gateway


def test_the_endpoint_table() -> None:
    assert match("POST", "/v1/responses") == (ENDPOINTS["/v1/responses"], "")
    assert match("GET", "/v1/responses/resp_1")[0].route == "response_get"  # type: ignore[index]
    assert match("DELETE", "/v1/responses/resp_1")[0].route == "response_delete"  # type: ignore[index]
    assert match("POST", "/v1/responses/resp_1/cancel") is not None
    assert match("GET", "/v1/responses/resp_1/cancel") is None
    assert match("PUT", "/v1/responses/resp_1") is None
    assert match("GET", "/v1/embeddings") is None
    assert match("POST", "/v1/nope") is None


POOLED = [
    ("/v1/embeddings", {"model": "m", "input": ["a", "b"]}),
    ("/v2/embed", {"model": "m", "texts": ["a"]}),
    ("/pooling", {"model": "m", "input": "a"}),
    ("/classify", {"model": "m", "input": "a"}),
    ("/score", {"model": "m", "text_1": "a", "text_2": "b"}),
    ("/v1/score", {"model": "m", "text_1": "a", "text_2": "b"}),
    ("/rerank", {"model": "m", "query": "q", "documents": ["a"]}),
    ("/v1/rerank", {"model": "m", "query": "q", "documents": ["a"]}),
    ("/v2/rerank", {"model": "m", "query": "q", "documents": ["a"]}),
    ("/tokenize", {"model": "m", "prompt": "hello"}),
    ("/detokenize", {"model": "m", "tokens": [1, 2]}),
]


@pytest.mark.parametrize(("path", "body"), POOLED)
async def test_pooled_endpoints_are_balanced_and_forwarded_unchanged(
    path: str, body: dict[str, Any]
) -> None:
    a, b = FakeApiEngine(A), FakeApiEngine(B)
    raw = json.dumps(body).encode()
    async with gateway(a, b) as (gw, _):
        answers = [
            await gw.post(path, content=raw, headers={"content-type": "application/json"})
            for _ in range(4)
        ]
    assert [r.status_code for r in answers] == [200] * 4
    assert all(r.json()["path"] == path for r in answers)
    assert a.raw == [raw] * len(a.raw) and b.raw == [raw] * len(b.raw)
    assert len(a.raw) >= 1 and len(b.raw) >= 1  # both engines served: load-balanced


async def test_pooled_requests_need_a_served_model() -> None:
    async with gateway(FakeApiEngine(A)) as (gw, _):
        r = await gw.post("/v1/embeddings", json={"model": "other", "input": "a"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"


async def test_audio_upload_reads_its_model_from_the_form() -> None:
    a = FakeApiEngine(A)
    async with gateway(a) as (gw, _):
        files = {"file": ("a.wav", b"RIFF" + bytes(2000), "audio/wav")}
        ok = await gw.post("/v1/audio/transcriptions", data={"model": "m"}, files=files)
        unknown = await gw.post("/v1/audio/translations", data={"model": "x"}, files=files)
        broken = await gw.post(
            "/v1/audio/transcriptions",
            content=b"not a form",
            headers={"content-type": "application/json"},
        )
    assert ok.status_code == 200 and ok.json()["text"] == f"heard by {A}"
    assert a.headers[0]["content-type"].startswith("multipart/form-data; boundary=")
    assert b"RIFF" in a.raw[0]
    assert unknown.status_code == 404
    assert broken.status_code == 400


@pytest.mark.parametrize("stream", [False, True])
async def test_a_follow_up_reaches_the_engine_that_stored_the_first_turn(stream: bool) -> None:
    a, b = FakeApiEngine(A), FakeApiEngine(B)
    async with gateway(a, b, policy=RR) as (gw, state):
        first = await gw.post(
            "/v1/responses", json={"model": "m", "input": "hello", "stream": stream}
        )
        owner = first.headers["x-kvgate-engine"]
        stored = a.stored if owner == A else b.stored
        (response_id,) = stored
        assert state.forwarder.responses.owner(response_id) == owner  # read from the answer
        for turn in range(4):  # round robin would alternate: every turn stays on the owner
            r = await gw.post(
                "/v1/responses",
                json={
                    "model": "m",
                    "input": f"turn {turn}",
                    "previous_response_id": response_id,
                    "stream": stream,
                },
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-kvgate-engine"] == owner
        got = await gw.get(f"/v1/responses/{response_id}")
        assert got.status_code == 200 and got.json()["id"] == response_id
        deleted = await gw.delete(f"/v1/responses/{response_id}")
        assert deleted.status_code == 200
        again = await gw.get(f"/v1/responses/{response_id}")
    assert again.status_code == 404
    assert again.json()["error"]["type"] == "not_found_error"


async def test_an_id_kvgate_never_saw_is_found_on_its_engine() -> None:
    a, b = FakeApiEngine(A), FakeApiEngine(B)
    b.stored["resp_made_elsewhere"] = {"id": "resp_made_elsewhere", "object": "response"}
    async with gateway(a, b, policy=RR) as (gw, _):
        owners = []
        for _ in range(3):
            r = await gw.post(
                "/v1/responses",
                json={"model": "m", "input": "x", "previous_response_id": "resp_made_elsewhere"},
            )
            owners.append(r.headers.get("x-kvgate-engine"))
        nobody = await gw.post(
            "/v1/responses", json={"model": "m", "input": "x", "previous_response_id": "resp_no"}
        )
        off = await gw.get("/v1/responses/resp_no")
    assert owners == [B, B, B]
    assert nobody.status_code == 404 and "resp_no" in nobody.json()["error"]["message"]
    assert nobody.json()["error"]["param"] == "previous_response_id"
    assert off.status_code == 404
    assert ("POST", "/v1/responses") not in a.calls  # never guessed onto the wrong engine


async def test_a_response_whose_engine_left_the_fleet_is_a_clear_error() -> None:
    a, b = FakeApiEngine(A), FakeApiEngine(B)
    async with gateway(a, b, policy=RR) as (gw, _):
        first = await gw.post("/v1/responses", json={"model": "m", "input": "hello"})
        owner = first.headers["x-kvgate-engine"]
        response_id = first.json()["id"]
        removed = await gw.delete("/admin/engines", params={"url": owner})
        assert removed.status_code == 200, removed.text
        r = await gw.post(
            "/v1/responses",
            json={"model": "m", "input": "again", "previous_response_id": response_id},
        )
    assert r.status_code == 404
    assert "left the fleet" in r.json()["error"]["message"]


async def test_responses_that_are_not_stored_are_not_pinned() -> None:
    a, b = FakeApiEngine(A), FakeApiEngine(B)
    async with gateway(a, b, policy=RR) as (gw, state):
        await gw.post("/v1/responses", json={"model": "m", "input": "x", "store": False})
        assert len(state.forwarder.responses.table) == 0
        await gw.post("/v1/responses", json={"model": "m", "input": "x"})
        assert len(state.forwarder.responses.table) == 1


async def test_messages_errors_take_anthropics_shape_and_x_api_key_authenticates() -> None:
    a = FakeApiEngine(A)
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    async with gateway(a, api_keys=["k1"]) as (gw, _):
        denied = await gw.post("/v1/messages", json=body)
        ok = await gw.post("/v1/messages", json=body, headers={"x-api-key": "k1"})
        unknown = await gw.post(
            "/v1/messages", json={**body, "model": "nope"}, headers={"x-api-key": "k1"}
        )
        bad = await gw.post(
            "/v1/messages", json={"model": "m", "messages": []}, headers={"x-api-key": "k1"}
        )
        counted = await gw.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": "k1"})
        chat_error = await gw.post(
            "/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            headers={"authorization": "Bearer k1"},
        )
    assert denied.status_code == 401
    assert denied.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": denied.json()["error"]["message"]},
    }
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    assert unknown.json()["type"] == "error"
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert counted.json() == {"input_tokens": 7}
    assert chat_error.json()["error"]["code"] == 404  # OpenAI's shape elsewhere


@pytest.mark.parametrize(
    ("path", "marker"), [("/v1/messages", b"api_error"), ("/v1/responses", b"upstream_error")]
)
async def test_a_stream_that_breaks_ends_in_its_apis_error_event(path: str, marker: bytes) -> None:
    a = FakeApiEngine(A, die_mid_stream=True)
    body: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": 4}
    body |= (
        {"input": "x"}
        if path == "/v1/responses"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    async with gateway(a) as (gw, _):
        r = await gw.post(path, json=body)
    assert r.status_code == 200
    tail = r.content.rsplit(b"\n\n", 2)[-2]
    assert tail.startswith(b"event: error\ndata: ") and marker in tail
    assert b"[DONE]" not in r.content


async def test_usage_of_responses_and_messages_reaches_the_completion_hook() -> None:
    a = FakeApiEngine(A)
    async with gateway(a) as (gw, state):
        seen: list[int | None] = []
        finished = state.dispatcher.finished

        def spy(info: Any, engine: str, now: float, *, ok: bool) -> None:
            seen.append(info.output_tokens)
            finished(info, engine, now, ok=ok)

        state.dispatcher.finished = spy
        await gw.post("/v1/responses", json={"model": "m", "input": "x"})
        await gw.post("/v1/responses", json={"model": "m", "input": "x", "stream": True})
        msg = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
        await gw.post("/v1/messages", json=msg)
        await gw.post("/v1/messages", json={**msg, "stream": True})
    assert seen == [4, 4, 6, 6]


async def test_cache_salts_are_never_credited_with_another_salts_blocks() -> None:
    a, b = FakeApiEngine(A), FakeApiEngine(B)
    prompt = [{"role": "system", "content": "A long shared system prompt. " * 60}]
    policy = {"name": "cache_aware"}
    async with gateway(a, b, policy=policy) as (gw, _):
        await gw.post("/v1/chat/completions", json={"model": "m", "messages": prompt})
        metrics = (await gw.get("/metrics")).text
        before = sample_sum(metrics, "kvgate_routed_expected_hit_tokens_total")
        for salt in ("s1", "s2", "s3"):
            body = {"model": "m", "messages": prompt, "cache_salt": salt}
            r = await gw.post("/v1/chat/completions", json=body)
            assert r.status_code == 200
        salted = sample_sum(
            (await gw.get("/metrics")).text, "kvgate_routed_expected_hit_tokens_total"
        )
        again = {"model": "m", "messages": prompt, "cache_salt": "s1"}
        await gw.post("/v1/chat/completions", json=again)
        repeat = sample_sum(
            (await gw.get("/metrics")).text, "kvgate_routed_expected_hit_tokens_total"
        )
        bad = await gw.post(
            "/v1/chat/completions", json={"model": "m", "messages": prompt, "cache_salt": ""}
        )
    assert before == 0
    assert salted == 0  # three salts: nothing shared with the unsalted prompt nor each other
    assert repeat > 0  # the same salt again is a hit
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


async def test_unknown_paths_are_openai_shaped_404s() -> None:
    async with gateway(FakeApiEngine(A)) as (gw, _):
        r = await gw.post("/v1/nothing", json={})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == 404
