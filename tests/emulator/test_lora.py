"""LoRA adapters and cache salts on the emulator: models, routing to adapters, runtime
loading, cache partitions (hits and KV events as vLLM keys them), lora_requests_info."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import httpx
import pytest

from gateway.cli.emulate import register, settings_from_args
from gateway.core.errors import ConfigError
from gateway.core.vllm_hash import LoraKey, block_ids, event_extra_keys
from gateway.emulator import EmulatorSettings
from gateway.emulator.kv_publisher import KVEventsConfig
from gateway.emulator.lora import RUNTIME_ENV
from tests.emulator.conftest import metrics_of, running_app, state_of, wait_for
from tests.emulator.test_kv_publisher import replayed, tokens

BASE = "base-llama"
ADAPTERS = (("sql", "/adapters/sql"), ("chat", "/adapters/chat"))
PROMPT = "0001" + "x" * (64 * 6 - 4)  # six full blocks with BOS
SETTINGS = EmulatorSettings(
    model=BASE, time_scale=0.01, max_model_len=4096, enable_lora=True, max_loras=2,
    lora_modules=ADAPTERS,
)  # fmt: skip


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvgate")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["emulate", *argv])


async def cached(client: httpx.AsyncClient, **extra: Any) -> int:
    body = {"prompt": PROMPT, "max_tokens": 2, **extra}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == extra.get("model", BASE)
    value: int = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return value


async def test_models_list_adapters_and_unknown_model() -> None:
    async with running_app(SETTINGS) as (_, client):
        cards = (await client.get("/v1/models")).json()["data"]
        assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
            (BASE, BASE, None),
            ("sql", "/adapters/sql", BASE),
            ("chat", "/adapters/chat", BASE),
        ]
        r = await client.post("/v1/chat/completions", json={"model": "nope", "messages": []})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert (await client.post("/v1/load_lora_adapter", json={})).status_code == 404


async def test_cache_is_partitioned_by_adapter_and_salt() -> None:
    async with running_app(SETTINGS) as (app, client):
        assert await cached(client) == 0
        assert await cached(client) == 96  # six blocks of 16
        assert await cached(client, model="sql") == 0  # no hit on the base model's blocks
        assert await cached(client, model="sql") == 96
        assert await cached(client, model="chat") == 0
        assert await cached(client, cache_salt="tenant-a") == 0
        assert await cached(client, cache_salt="tenant-a") == 96
        assert await cached(client, cache_salt="tenant-b") == 0
        assert await cached(client, model="sql", cache_salt="tenant-a") == 0
        text = (await client.get("/metrics")).text
        m = metrics_of(text)
        assert m["vllm:prefix_cache_hits_total"] == 3 * 96
        assert m["vllm:prefix_cache_queries_total"] == 9 * 97
        assert state_of(app).driver.core.lora_info.max_loras == 2


@pytest.mark.parametrize(
    ("salt", "fragment"),
    [
        ("", "non-empty string"),
        (7, "non-empty string"),
        ("a" * 129, "at most 128"),
        ("a@b", "at most 128"),
    ],
)
async def test_cache_salt_is_checked_on_every_route(salt: Any, fragment: str) -> None:
    async with running_app(SETTINGS) as (_, client):
        for path, body in (
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            ("/v1/responses", {"input": "x"}),
        ):
            r = await client.post(path, json={**body, "cache_salt": salt})
            assert r.status_code == 400, path
            err = r.json()["error"]
            assert err["param"] == "cache_salt" and fragment in err["message"], path
        ok = await client.post("/v1/completions", json={"prompt": "x", "cache_salt": "a" * 128})
        assert ok.status_code == 200


async def test_runtime_load_and_unload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RUNTIME_ENV, "True")
    async with running_app(EmulatorSettings(model=BASE, enable_lora=True)) as (_, client):
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/p"})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'x' added successfully.")
        again = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/p"}
        )
        assert (
            again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        )
        assert again.json()["error"]["type"] == "InvalidUserInput"  # vLLM's type
        clash = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": "/p"}
        )
        assert clash.status_code == 400
        assert (
            await client.post("/v1/load_lora_adapter", json={"lora_name": "y"})
        ).status_code == 400
        ids = [c["id"] for c in (await client.get("/v1/models")).json()["data"]]
        assert ids == [BASE, "x"]
        ran = await client.post("/v1/completions", json={"model": "x", "prompt": "hi"})
        assert ran.status_code == 200
        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
        assert (gone.status_code, gone.text) == (
            200,
            "Success: LoRA adapter 'x' removed successfully.",
        )
        missing = await client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
        assert missing.status_code == 404
        late = await client.post("/v1/completions", json={"model": "x", "prompt": "hi"})
        assert late.status_code == 404
    monkeypatch.delenv(RUNTIME_ENV)
    flagged = EmulatorSettings(model=BASE, enable_lora=True, allow_runtime_lora=True)
    async with running_app(flagged) as (_, client):
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/p"})
        assert r.status_code == 200


async def test_lora_requests_info() -> None:
    async with running_app(SETTINGS) as (app, client):

        def info() -> dict[str, float]:
            return {
                k: v for k, v in metrics_of(text).items() if k.startswith("vllm:lora_requests_info")
            }

        text = (await client.get("/metrics")).text
        assert list(info()) == [
            "vllm:lora_requests_info|max_lora=2|running_lora_adapters=|waiting_lora_adapters="
        ]
        body = {"model": "sql", "prompt": "long", "max_tokens": 3000, "ignore_eos": True}
        task = client.post("/v1/completions", json=body)
        pending = asyncio.ensure_future(task)
        await wait_for(lambda: state_of(app).driver.core.num_running == 1)
        text = (await client.get("/metrics")).text
        (key,) = info()
        assert "running_lora_adapters=sql" in key and info()[key] > 1.7e9  # a wall-clock time
        state_of(app).driver.abort(state_of(app).driver.core.running[0].id)
        await pending
    async with running_app(EmulatorSettings()) as (_, client):
        text = (await client.get("/metrics")).text
        assert "vllm:lora_requests_info" not in text  # only with --enable-lora, as vLLM


async def test_kv_events_carry_lora_and_salt_keys() -> None:
    events = KVEventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    settings = EmulatorSettings(
        model=BASE, time_scale=0.01, max_model_len=4096, enable_lora=True,
        lora_modules=ADAPTERS, kv_events=events,
    )  # fmt: skip
    async with running_app(settings) as (app, client):
        ids = await tokens(client, PROMPT)
        await cached(client, model="chat", cache_salt="s1")
        replay = state_of(app).kv_events
        assert replay is not None and replay.replay_endpoint is not None
        await wait_for(lambda: replay.batches >= 1)
        stored = [e for _, _, batch in await replayed(replay.replay_endpoint) for e in batch]
        assert [e["type"] for e in stored] == ["BlockStored"]
        event = stored[0]
        key = LoraKey("chat", "/adapters/chat")
        assert event["block_hashes"] == list(block_ids(ids, 16, lora=key, cache_salt="s1"))
        assert event["block_hashes"] != list(block_ids(ids, 16))
        assert event["parent_block_hash"] is None and event["token_ids"] == ids[:96]
        assert (event["lora_id"], event["lora_name"]) == (2, "chat")
        expected = event_extra_keys(6, lora=key, cache_salt="s1") or []
        assert event["extra_keys"] == [list(e) if e else e for e in expected]
        assert event["extra_keys"][:2] == [["chat", "s1"], ["chat"]]


def test_cli_flags() -> None:
    settings = settings_from_args(
        parse("--enable-lora", "--max-loras", "3", "--max-lora-rank", "64",
              "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--allow-runtime-lora",
              "--responses-store-size", "8")
    )  # fmt: skip
    assert settings.lora_modules == (("a", "/x"), ("b", "/y"))
    assert (settings.max_loras, settings.max_lora_rank, settings.responses_store_size) == (3, 64, 8)
    assert settings.perf_model().max_loras == 3
    pooled = settings_from_args(parse("--runner", "pooling", "--convert", "classify"))
    assert (pooled.runner, pooled.convert) == ("pooling", "classify")
    assert settings_from_args(parse("--transcription")).transcription
    for argv, message in (
        (("--lora-modules", "a"), "name=path"),
        (("--max-loras", "0"), "--max-loras must be positive"),
    ):
        with pytest.raises(ConfigError, match=message):
            settings_from_args(parse(*argv))
    with pytest.raises(ConfigError, match="enable_lora"):
        settings_from_args(parse("--lora-modules", "a=/x")).perf_model()
