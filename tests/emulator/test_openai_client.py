"""End to end: a real uvicorn emulator on 127.0.0.1 and the official ``openai`` client."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from fastapi import FastAPI

from gateway.emulator import EmulatorSettings
from tests.emulator.conftest import metrics_of, serve, state_of

MODEL = "emulated-llama"
LONG = "Shared system prompt about KV-cache-aware routing of LLM requests. " * 40


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FastAPI]]:
    with serve(EmulatorSettings(model=MODEL, time_scale=0.02, max_model_len=8192)) as pair:
        yield pair


@pytest.fixture(scope="module")
def client(server: tuple[str, FastAPI]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_non_stream(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=12
    )
    assert reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in {"stop", "length"}
    assert reply.usage is not None and reply.usage.completion_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "terse"}, {"role": "user", "content": "Explain."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=400)  # type: ignore[arg-type]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=400,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens  # type: ignore[union-attr]


def test_completions_stream_and_non_stream(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20)
    assert plain.id.startswith("cmpl-") and plain.usage is not None
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_repeated_long_prompt_is_served_from_cache(client: openai.OpenAI) -> None:
    first = client.completions.create(model=MODEL, prompt=LONG, max_tokens=4)
    second = client.completions.create(model=MODEL, prompt=LONG, max_tokens=4)
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= first.usage.prompt_tokens - 16
    assert second.choices[0].text == first.choices[0].text


def test_errors_map_to_openai_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)


def test_disconnect_mid_stream_aborts(server: tuple[str, FastAPI]) -> None:
    base, app = server
    body = {
        "model": MODEL,
        "prompt": "long",
        "max_tokens": 5000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=base, timeout=10) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert got[0].startswith("data: ")
        running = metrics_of(http.get("/metrics").text)["vllm:num_requests_running"]
        assert running == 1
    with httpx.Client(base_url=base, timeout=10) as http:
        deadline = time.monotonic() + 5
        while True:
            m = metrics_of(http.get("/metrics").text)
            if m["vllm:num_requests_running"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:request_success_total|finished_reason=abort"] >= 1
    assert state_of(app).driver.in_flight == 0
