"""P/D roles in-process: prefill legs, pins and their lease, validation, --role flags."""

from __future__ import annotations

import argparse
import math
from typing import Any

import httpx
import pytest

from gateway.cli import emulate
from gateway.core.errors import ConfigError
from gateway.emulator import EmulatorSettings
from tests.emulator.conftest import (
    TO_PREFILL,
    metrics_of,
    prefill_leg,
    running_app,
    state_of,
    wait_for,
)

PROMPT = "Disaggregated serving splits prefill from decode across engines. " * 20
KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_prefill_cached_tokens",
}


def fast(**changes: Any) -> EmulatorSettings:
    return EmulatorSettings(time_scale=0.01, max_model_len=8192, engine_id="eng-P", **changes)


# -- prefill legs -----------------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "both"])
async def test_prefill_leg_returns_params_and_pins_kv(role: str) -> None:
    async with running_app(fast(role=role)) as (app, client):
        state = state_of(app)
        r = await client.post(
            "/v1/completions",
            headers={"X-Request-Id": "abc"},
            json={"prompt": PROMPT, "max_tokens": 50, "kv_transfer_params": TO_PREFILL},
        )
        body = r.json()
        prompt = body["usage"]["prompt_tokens"]
        assert body["usage"]["completion_tokens"] == 1  # the prefill leg is capped at one
        assert body["choices"][0]["finish_reason"] == "length"
        params = body["kv_transfer_params"]
        assert set(params) == KEYS
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == "eng-P" == state.engine_id
        assert params["remote_request_id"].startswith("cmpl-abc-")
        assert params["remote_host"] == "127.0.0.1" and isinstance(params["remote_port"], int)
        assert params["tp_size"] == 1 and params["transfer_mode"] == "pull"
        assert params["remote_num_tokens"] == prompt
        (ids,) = params["remote_block_ids"]
        assert len(ids) == math.ceil(prompt / state.perf.block_size)
        assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids)
        assert params["remote_prefill_cached_tokens"] == 0
        # the prompt's full blocks stay held until the decode engine reads them
        pin = state.driver.pins.get(params["remote_request_id"])
        assert pin is not None and len(pin.hashes) == prompt // state.perf.block_size
        assert state.driver.core.pool.used == len(pin.hashes)
        again = await prefill_leg(client, PROMPT)  # now a prefix-cache hit on P
        assert again["kv_transfer_params"]["remote_prefill_cached_tokens"] > 0
        for p in (params, again["kv_transfer_params"]):
            rel = await client.post(
                "/kvgate/kv_release",
                json={"remote_request_id": p["remote_request_id"], "remote_engine_id": "eng-P"},
            )
            assert rel.json() == {"released": True}
        assert len(state.driver.pins) == 0 and state.driver.core.pool.used == 0
        rel = await client.post("/kvgate/kv_release", json={"remote_request_id": "nope"})
        assert rel.json() == {"released": False}
        m = metrics_of((await client.get("/metrics")).text)
        assert m["vllm:nixl_num_notifications_after_expiry_total"] == 1


async def test_streamed_prefill_leg_carries_params_on_the_last_chunk() -> None:
    async with running_app(fast(role="prefill")) as (_, client):
        r = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 9,
                "stream": True,
                "kv_transfer_params": TO_PREFILL,
            },
        )
        chunks = [
            httpx.Response(200, content=line.removeprefix("data: ")).json()
            for line in r.text.split("\n\n")
            if line.startswith("data: {")
        ]
        last = chunks[-1]
        assert last["choices"][0]["finish_reason"] == "length"
        assert last["kv_transfer_params"]["do_remote_prefill"] is True
        assert all("kv_transfer_params" not in c for c in chunks[:-1])


async def test_unread_pins_expire_after_the_lease() -> None:
    async with running_app(fast(role="prefill", kv_lease_s=0.1)) as (app, client):
        pins = state_of(app).driver.pins
        body = await prefill_leg(client, PROMPT)
        assert body["kv_transfer_params"]["remote_request_id"] in pins
        await wait_for(lambda: len(pins) == 0, timeout=2.0)
        assert state_of(app).driver.core.pool.used == 0
        m = metrics_of((await client.get("/metrics")).text)
        assert m["vllm:nixl_num_kv_expired_reqs_total"] == 1
        rel = await client.post(
            "/kvgate/kv_release",
            json={"remote_request_id": body["kv_transfer_params"]["remote_request_id"]},
        )
        assert rel.json() == {"released": False}


async def test_release_for_another_engine_is_ignored() -> None:
    async with running_app(fast(role="prefill")) as (app, client):
        params = (await prefill_leg(client, PROMPT))["kv_transfer_params"]
        rel = await client.post(
            "/kvgate/kv_release",
            json={"remote_request_id": params["remote_request_id"], "remote_engine_id": "x"},
        )
        assert rel.json() == {"released": False} and len(state_of(app).driver.pins) == 1
        bad = await client.post("/kvgate/kv_release", json={"remote_request_id": 5})
        assert bad.status_code == 400


# -- roles and plain requests ---------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode", "both"])
async def test_plain_requests_are_served_on_every_role(role: str) -> None:
    async with running_app(fast(role=role)) as (app, client):
        r = await client.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 7, "ignore_eos": True}
        )
        body = r.json()
        assert body["usage"]["completion_tokens"] == 7
        assert body["kv_transfer_params"] is None
        assert len(state_of(app).driver.pins) == 0


async def test_a_decode_engine_serves_a_prefill_leg_as_a_plain_request() -> None:
    async with running_app(fast(role="decode")) as (app, client):
        body = await prefill_leg(client, PROMPT)
        assert body["kv_transfer_params"] is None and len(state_of(app).driver.pins) == 0


async def test_a_prefill_engine_computes_a_decode_leg_itself() -> None:
    async with running_app(fast(role="prefill")) as (_, client):
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "elsewhere",
            "remote_host": "127.0.0.1",
            "remote_port": 9,
            "remote_request_id": "r1",
            "remote_block_ids": [[1, 2, 3]],
        }
        r = await client.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 3, "kv_transfer_params": params},
        )
        assert r.status_code == 200
        m = metrics_of((await client.get("/metrics")).text)
        assert m["vllm:prompt_tokens_by_source_total|source=external_kv_transfer"] == 0
        assert m["vllm:prompt_tokens_by_source_total|source=local_compute"] > 0


BAD_PARAMS: list[Any] = [
    "do_remote_decode",
    [TO_PREFILL],
    7,
    {"do_remote_decode": "yes"},
    {"do_remote_decode": True, "do_remote_prefill": True},
    {"do_remote_prefill": True, "remote_engine_id": "e", "remote_port": 8000},
    {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "h", "remote_port": "80"},
    {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "h", "remote_port": 0},
    {"do_remote_prefill": True, "remote_host": "h", "remote_port": 8000},
    {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_host": "h",
        "remote_port": 8000,
        "remote_block_ids": "1,2",
    },
    {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_host": "h",
        "remote_port": 8000,
        "remote_num_tokens": -1,
    },
]


@pytest.mark.parametrize("params", BAD_PARAMS)
@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_malformed_kv_transfer_params_are_a_400(params: Any, role: str) -> None:
    async with running_app(fast(role=role)) as (_, client):
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": params},
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400
        assert error["param"] == "kv_transfer_params"
        assert "kv_transfer_params" in error["message"]


# -- flags -----------------------------------------------------------------------------------


def parse(*argv: str) -> EmulatorSettings:
    parser = argparse.ArgumentParser()
    emulate.register(parser.add_subparsers())
    return emulate.settings_from_args(parser.parse_args(["emulate", *argv]))


def test_role_flags() -> None:
    default = parse()
    assert (default.role, default.kv_bandwidth_gbps, default.kv_lease_s) == ("both", 25.0, 30.0)
    assert default.engine_id is None
    s = parse("--role", "prefill", "--kv-bandwidth", "50", "--kv-lease", "5", "--engine-id", "p-0")
    assert (s.role, s.kv_bandwidth_gbps, s.kv_lease_s, s.kv_engine_id()) == (
        "prefill",
        50.0,
        5.0,
        "p-0",
    )
    assert parse("--role", "decode").role == "decode"
    with pytest.raises(SystemExit):
        parse("--role", "router")
    with pytest.raises(ConfigError, match="kv-bandwidth"):
        parse("--kv-bandwidth", "0")
    with pytest.raises(ConfigError, match="kv-lease"):
        parse("--kv-lease", "-1")


def test_default_engine_id_is_stable_per_address_and_seed() -> None:
    a = EmulatorSettings(port=8001)
    assert a.kv_engine_id() == EmulatorSettings(port=8001).kv_engine_id()
    assert a.kv_engine_id() != EmulatorSettings(port=8002).kv_engine_id()
    assert a.kv_engine_id() != EmulatorSettings(port=8001, seed=1).kv_engine_id()
    with pytest.raises(ConfigError, match="role"):
        EmulatorSettings(role="router").perf_model()  # type: ignore[arg-type]
