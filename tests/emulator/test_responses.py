"""``/v1/responses`` on a real emulator, with the official ``openai`` client and httpx."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from fastapi import FastAPI

from gateway.emulator import EmulatorSettings
from tests.emulator.conftest import serve, state_of

MODEL = "emulated-llama"
SYSTEM = "You answer questions about KV-cache-aware routing of LLM requests. " * 12


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FastAPI]]:
    settings = EmulatorSettings(
        model=MODEL, time_scale=0.02, max_model_len=8192, responses_store_size=4
    )
    with serve(settings) as pair:
        yield pair


@pytest.fixture(scope="module")
def client(server: tuple[str, FastAPI]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_create_non_stream(client: openai.OpenAI) -> None:
    reply = client.responses.create(
        model=MODEL, instructions="Be terse.", input="What is a prefix cache?", max_output_tokens=8
    )
    assert reply.id.startswith("resp_") and reply.object == "response"
    assert reply.status in {"completed", "incomplete"}
    assert reply.output_text and reply.output[0].type == "message"
    usage = reply.usage
    assert usage is not None and usage.output_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0


def test_stream_event_sequence(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(model=MODEL, input="Stream it.", max_output_tokens=6, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.id == events[0].response.id  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens == 6


def test_follow_up_continues_the_stored_conversation(
    client: openai.OpenAI, server: tuple[str, FastAPI]
) -> None:
    first = client.responses.create(
        model=MODEL, instructions=SYSTEM, input="One?", max_output_tokens=4
    )
    second = client.responses.create(
        model=MODEL,
        instructions=SYSTEM,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Two?"}]}],
        previous_response_id=first.id,
        max_output_tokens=4,
    )
    assert first.usage is not None and second.usage is not None
    # the follow-up's prompt is the first prompt, its answer and the new input
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_function_call_items_render(client: openai.OpenAI) -> None:
    reply = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        tools=[{"type": "function", "name": "weather", "parameters": {"type": "object"}}],
        max_output_tokens=3,
    )
    assert reply.tools[0].name == "weather"  # type: ignore[union-attr]
    assert reply.tool_choice == "auto"


def test_unknown_id_is_404(client: openai.OpenAI, server: tuple[str, FastAPI]) -> None:
    with pytest.raises(openai.NotFoundError, match="Response with id 'resp_nope' not found"):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    r = httpx.get(server[0] + "/v1/responses/resp_nope")
    assert r.status_code == 404
    assert r.json() == {  # as a real vLLM 0.32 answers it
        "error": {
            "message": "Response with id 'resp_nope' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }
    assert httpx.delete(server[0] + "/v1/responses/resp_nope").status_code == 405  # no DELETE


def test_store_false_and_bounded_store(client: openai.OpenAI, server: tuple[str, FastAPI]) -> None:
    kept = client.responses.create(model=MODEL, input="keep", max_output_tokens=2)
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for i in range(4):  # capacity 4: the oldest goes
        client.responses.create(model=MODEL, input=f"fill {i}", max_output_tokens=2)
    assert len(state_of(server[1]).responses) == 4
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_background_cancel(client: openai.OpenAI, server: tuple[str, FastAPI]) -> None:
    queued = client.responses.create(
        model=MODEL,
        input="long",
        max_output_tokens=2000,
        background=True,
        extra_body={"ignore_eos": True},
    )
    assert queued.status == "queued" and queued.background
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert state_of(server[1]).driver.in_flight == 0
    done = client.responses.create(model=MODEL, input="quick", max_output_tokens=2)
    r = httpx.post(f"{server[0]}/v1/responses/{done.id}/cancel")
    assert r.status_code == 400 and "synchronous" in r.json()["error"]["message"]


def test_bad_requests(server: tuple[str, FastAPI]) -> None:
    url = server[0] + "/v1/responses"
    r = httpx.post(url, json={"input": "x", "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(url, json={"input": "x", "cache_salt": "a/b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    r = httpx.post(url, content=json.dumps({"instructions": "no input"}))
    assert r.status_code == 400
    r = httpx.post(url, json={"input": [{"type": "mystery"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
