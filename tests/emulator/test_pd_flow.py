"""The two-leg P/D flow: a prefill emulator and a decode emulator on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from gateway.emulator import EmulatorSettings
from gateway.emulator.driver import EngineDriver
from gateway.emulator.kvtransfer import KvTransfer
from tests.emulator.conftest import (
    TO_PREFILL,
    metrics_of,
    prefill_leg,
    running_app,
    serve,
    state_of,
    wait_for,
)

BANDWIDTH = 4.0  # GB/s: moving a prompt's KV takes about as long as computing it
SCALE = 0.5
LONG = "Prefill engines compute prompts and decode engines stream the answers. " * 250


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[tuple[str, FastAPI], tuple[str, FastAPI]]]:
    common: dict[str, Any] = {"time_scale": SCALE, "max_model_len": 8192}
    with (
        serve(EmulatorSettings(role="prefill", **common)) as p,
        serve(EmulatorSettings(role="decode", kv_bandwidth_gbps=BANDWIDTH, **common)) as d,
    ):
        yield p, d


def sse_payloads(text: str) -> list[dict[str, Any]]:
    assert text.endswith("data: [DONE]\n\n")
    return [json.loads(f[6:]) for f in text.split("\n\n") if f.startswith("data: {")]


async def proxy(
    p_url: str, d_url: str, body: dict[str, Any], path: str = "/v1/completions"
) -> tuple[dict[str, Any], httpx.Response]:
    """What a P/D proxy does: the prefill leg, then the decode leg with its params."""
    async with httpx.AsyncClient(timeout=20) as client:
        p_body = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": TO_PREFILL}
        p_body.pop("stream_options", None)
        first = await client.post(p_url + path, json=p_body, headers={"X-Request-Id": "pd-1"})
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]
        second = await client.post(
            d_url + path,
            json={**body, "kv_transfer_params": params},
            headers={"X-Request-Id": "pd-1"},
        )
        assert second.status_code == 200, second.text
        return params, second


async def test_two_leg_flow(pair: tuple[tuple[str, FastAPI], tuple[str, FastAPI]]) -> None:
    (p_url, p_app), (d_url, d_app) = pair
    p_state, d_state = state_of(p_app), state_of(d_app)
    body = {"prompt": LONG, "max_tokens": 20, "ignore_eos": True}
    params, reply = await proxy(p_url, d_url, body)
    assert params["remote_port"] == int(p_url.rsplit(":", 1)[1])
    assert params["remote_engine_id"] == p_state.engine_id != d_state.engine_id
    out = reply.json()
    prompt = out["usage"]["prompt_tokens"]
    assert prompt == params["remote_num_tokens"] > 4000
    assert out["usage"]["completion_tokens"] == 20 and len(out["choices"][0]["text"].split()) == 20
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # P's own hits
    assert out["kv_transfer_params"] is None
    # the decode engine told the prefill engine; its pinned blocks are gone
    await wait_for(lambda: len(p_state.driver.pins) == 0)
    assert p_state.driver.core.pool.used == 0

    bs = d_state.perf.block_size
    loaded = (prompt - 1) // bs * bs
    async with httpx.AsyncClient() as client:
        m = metrics_of((await client.get(d_url + "/metrics")).text)
    assert m["vllm:prompt_tokens_by_source_total|source=external_kv_transfer"] == loaded
    assert m["vllm:prompt_tokens_by_source_total|source=local_compute"] == prompt - loaded
    assert m["vllm:prompt_tokens_by_source_total|source=local_cache_hit"] == 0
    assert m["vllm:external_prefix_cache_hits_total"] == loaded
    assert m["vllm:nixl_xfer_time_seconds_count"] == 1
    assert m["vllm:nixl_bytes_transferred_sum"] == loaded * d_state.perf.kv_bytes_per_token
    assert m["vllm:nixl_num_failed_notifications_total"] == 0
    # TTFT = the transfer plus one small step, not the prompt's prefill
    transfer = d_state.kv.transfer_time(loaded)
    prefill = d_state.perf.prefill_time(prompt)
    ttft = m["vllm:time_to_first_token_seconds_sum"]
    assert transfer <= ttft < transfer + prefill / 2, (ttft, transfer, prefill)
    assert m["vllm:nixl_xfer_time_seconds_sum"] == pytest.approx(transfer)


async def test_streamed_chat_decode_leg(
    pair: tuple[tuple[str, FastAPI], tuple[str, FastAPI]],
) -> None:
    (p_url, p_app), (d_url, _) = pair
    body = {
        "messages": [{"role": "user", "content": "Stream please. " + LONG[:3000]}],
        "max_tokens": 12,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    _, reply = await proxy(p_url, d_url, body, "/v1/chat/completions")
    chunks = sse_payloads(reply.text)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text.split()) == 12
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    await wait_for(lambda: len(state_of(p_app).driver.pins) == 0)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_unreachable_prefill_engine_still_serves() -> None:
    settings = EmulatorSettings(role="decode", time_scale=0.01, max_model_len=8192)
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "gone",
        "remote_request_id": "cmpl-x-1",
        "remote_host": "127.0.0.1",
        "remote_port": closed_port(),
        "remote_block_ids": [1, 2, 3],
    }
    async with running_app(settings) as (app, client):
        r = await client.post(
            "/v1/completions",
            json={"prompt": LONG[:2000], "max_tokens": 5, "kv_transfer_params": params},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5
        # without remote_prefill_cached_tokens, vLLM reports what it did not compute
        prompt = r.json()["usage"]["prompt_tokens"]
        bs = state_of(app).perf.block_size
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (
            (prompt - 1) // bs * bs
        )

        async def failed() -> float:
            return metrics_of((await client.get("/metrics")).text)[
                "vllm:nixl_num_failed_notifications_total"
            ]

        for _ in range(300):
            if await failed() == 1:
                break
            await asyncio.sleep(0.01)
        assert await failed() == 1


async def test_an_engine_of_both_roles_pulls_from_itself() -> None:
    settings = EmulatorSettings(time_scale=0.01, max_model_len=8192)
    async with running_app(settings) as (app, client):
        state = state_of(app)
        params = (await prefill_leg(client, LONG[:2000]))["kv_transfer_params"]
        assert len(state.driver.pins) == 1
        r = await client.post(
            "/v1/completions",
            json={"prompt": LONG[:2000], "max_tokens": 4, "kv_transfer_params": params},
        )
        assert r.status_code == 200 and len(state.driver.pins) == 0  # released directly
        # the local prefix cache already holds the prompt: nothing to move
        m = metrics_of((await client.get("/metrics")).text)
        assert m["vllm:prompt_tokens_by_source_total|source=external_kv_transfer"] == 0
        assert m["vllm:nixl_xfer_time_seconds_count"] == 0


async def test_a_pulling_request_waits_as_deferred() -> None:
    settings = EmulatorSettings(role="decode", time_scale=0.1, kv_bandwidth_gbps=0.05)
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "p",
        "remote_host": "127.0.0.1",
        "remote_port": closed_port(),
    }  # no remote_request_id (vLLM 0.11 params): no release notice
    async with running_app(settings) as (app, client):
        state = state_of(app)
        task = asyncio.create_task(
            client.post(
                "/v1/completions",
                json={"prompt": LONG[:2000], "max_tokens": 4, "kv_transfer_params": params},
            )
        )
        await wait_for(lambda: state.kv.in_flight == 1)
        m = metrics_of((await client.get("/metrics")).text)
        assert m["vllm:num_requests_waiting_by_reason|reason=deferred"] == 1
        assert m["vllm:num_requests_waiting"] == 1
        assert (await client.get("/load")).json() == {"server_load": 1}
        r = await task
        assert r.status_code == 200 and state.kv.in_flight == 0
        m = metrics_of((await client.get("/metrics")).text)
        assert m["vllm:num_requests_waiting_by_reason|reason=deferred"] == 0
        assert m["vllm:nixl_num_failed_notifications_total"] == 0


async def test_a_rejected_decode_leg_frees_the_prefill_kv() -> None:
    settings = EmulatorSettings(time_scale=0.01, max_model_len=1024)
    async with running_app(settings) as (app, client):
        params = (await prefill_leg(client, "short prompt " * 40))["kv_transfer_params"]
        r = await client.post(
            "/v1/completions",
            json={"prompt": "short prompt " * 40, "max_tokens": 5000, "kv_transfer_params": params},
        )
        assert r.status_code == 400
        assert len(state_of(app).driver.pins) == 0


async def test_transfer_time_follows_bandwidth() -> None:
    perf = EmulatorSettings().perf_model()
    driver = EngineDriver(perf)
    kv = KvTransfer(driver, None, engine_id="e", bandwidth_gbps=25.0)  # type: ignore[arg-type]
    assert kv.transfer_time(1000) == pytest.approx(1000 * perf.kv_bytes_per_token / 25e9)
    await kv.close()
    with pytest.raises(ValueError, match="bandwidth"):
        KvTransfer(driver, None, engine_id="e", bandwidth_gbps=0)  # type: ignore[arg-type]
