"""``/v1/messages`` and ``/v1/messages/count_tokens`` with the official ``anthropic`` client."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import pytest
from fastapi import FastAPI

from gateway.emulator import EmulatorSettings
from tests.emulator.conftest import serve

MODEL = "emulated-llama"
SYSTEM = "You are a terse assistant about KV caches and routing of LLM requests. " * 10
TOOLS = [{"name": "lookup", "description": "look up", "input_schema": {"type": "object"}}]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FastAPI]]:
    with serve(EmulatorSettings(model=MODEL, time_scale=0.02, max_model_len=8192)) as pair:
        yield pair


@pytest.fixture(scope="module")
def client(server: tuple[str, FastAPI]) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0) as c:
        yield c


def test_create_non_stream(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in {"end_turn", "max_tokens"}
    assert 0 < msg.usage.output_tokens <= 8
    assert msg.usage.cache_read_input_tokens == 0
    assert msg.usage.cache_creation_input_tokens == 0  # vLLM 0.32 reports it too


def test_stream_matches_non_stream_and_reports_cache_reads(client: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Explain routing."}]}]
    plain = client.messages.create(
        model=MODEL,
        max_tokens=12,
        system=SYSTEM,
        messages=messages,  # type: ignore[arg-type]
    )
    with client.messages.stream(
        model=MODEL,
        max_tokens=12,
        system=SYSTEM,
        messages=messages,  # type: ignore[arg-type]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "ping" not in kinds and "content_block_delta" in kinds
    assert final.content[0].text == plain.content[0].text  # type: ignore[union-attr]
    # the same prompt again: its full blocks come from the prefix cache
    assert final.usage.cache_read_input_tokens is not None
    assert final.usage.cache_read_input_tokens > 0
    total = final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert total == plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0)


def test_raw_stream_events(server: tuple[str, FastAPI]) -> None:
    body = {"model": MODEL, "max_tokens": 3, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    text = httpx.post(server[0] + "/v1/messages", json=body).text
    events = [block.split("\n")[0] for block in text.strip().split("\n\n")]
    assert events == [
        "event: message_start",
        "event: content_block_start",
        "event: content_block_delta",
        "event: content_block_delta",
        "event: content_block_delta",
        "event: content_block_stop",
        "event: message_delta",
        "event: message_stop",
    ]
    assert '"stop_reason":"max_tokens"' in text and '"output_tokens":3' in text


def test_tool_blocks_and_count_tokens(client: anthropic.Anthropic) -> None:
    call = {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "x"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "found"}
    messages = [
        {"role": "user", "content": "Find x"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    counted = client.messages.count_tokens(
        model=MODEL,
        system=SYSTEM,
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
    )
    msg = client.messages.create(
        model=MODEL,
        max_tokens=2,
        system=SYSTEM,
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
    )
    assert counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    shorter = client.messages.count_tokens(model=MODEL, messages=messages[:1])  # type: ignore[arg-type]
    assert shorter.input_tokens < counted.input_tokens


def test_errors(client: anthropic.Anthropic, server: tuple[str, FastAPI]) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(
            model="gpt-9", max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.body == {
        "type": "error",
        "error": {
            "type": "NotFoundError",
            "message": f"The model `gpt-9` does not exist. Valid aliases: {MODEL}.",
        },
    }
    r = httpx.post(server[0] + "/v1/messages", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # vLLM's 400
    salted = {"model": MODEL, "max_tokens": 2, "messages": [], "cache_salt": "x" * 200}
    r = httpx.post(server[0] + "/v1/messages", json=salted)
    assert r.status_code == 400 and r.json() == {
        "type": "error",
        "error": {
            "type": "BadRequestError",
            "message": "Parameter 'cache_salt' must be at most 128 characters and must not "
            "contain '@', '/', '\\\\', or NUL. (parameter=cache_salt)",
        },
    }
