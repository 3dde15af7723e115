"""The pooling runner (embeddings with the ``openai`` client, pooling/score/rerank/classify
with httpx), the routes each runner lacks, and speech to text."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator

import httpx
import openai
import pytest
from fastapi import FastAPI

from gateway.emulator import EmulatorSettings
from gateway.emulator.pooling import EMBED_DIM
from tests.emulator.conftest import metrics_of, running_app, serve

MODEL = "emulated-embed"
NOT_FOUND = {"detail": "Not Found"}  # FastAPI's, as a real vLLM 0.32 answers


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FastAPI]]:
    settings = EmulatorSettings(model=MODEL, time_scale=0.02, runner="pooling")
    with serve(settings) as pair:
        yield pair


@pytest.fixture(scope="module")
def client(server: tuple[str, FastAPI]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_embeddings_float_base64_and_dimensions(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(
        model=MODEL, input=["a cat", "a dog"], encoding_format="float"
    )
    assert [d.index for d in floats.data] == [0, 1]
    vec = floats.data[0].embedding
    assert len(vec) == EMBED_DIM and math.isclose(sum(x * x for x in vec), 1.0)
    assert floats.data[1].embedding != vec
    b64 = client.embeddings.create(model=MODEL, input="a cat", encoding_format="base64")
    raw = base64.b64decode(str(b64.data[0].embedding))
    assert struct.unpack(f"<{EMBED_DIM}f", raw) == pytest.approx(vec, abs=1e-6)  # float32 LE
    default = client.embeddings.create(model=MODEL, input="a cat")  # the SDK asks for base64
    assert default.data[0].embedding == pytest.approx(vec, abs=1e-6)
    short = client.embeddings.create(model=MODEL, input="a cat", dimensions=8)
    assert len(short.data[0].embedding) == 8
    tokens = client.embeddings.create(model=MODEL, input=[[1, 5, 9], [1, 5]])
    assert floats.usage.prompt_tokens > 0 and tokens.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=MODEL, input="x", dimensions=EMBED_DIM + 1)


def test_embedding_costs_a_prefill(server: tuple[str, FastAPI]) -> None:
    base = server[0]
    before = metrics_of(httpx.get(base + "/metrics").text)
    r = httpx.post(base + "/v1/embeddings", json={"input": "word " * 200})
    assert r.status_code == 200
    after = metrics_of(httpx.get(base + "/metrics").text)
    prompt = r.json()["usage"]["prompt_tokens"]
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == prompt


def test_pooling_score_rerank(server: tuple[str, FastAPI]) -> None:
    base = server[0]
    assert httpx.post(base + "/v1/embeddings", json={"input": "x"}).json()["id"].startswith("embd-")
    pooled = httpx.post(base + "/pooling", json={"input": "a cat"}).json()
    assert pooled["id"].startswith("pooling-") and pooled["data"][0]["object"] == "pooling"
    embedded = httpx.post(base + "/v1/embeddings", json={"input": "a cat"}).json()
    assert pooled["data"][0]["data"] == embedded["data"][0]["embedding"]
    for path in ("/score", "/v1/score"):
        body = {"queries": "a cat", "documents": ["a cat", "a dog"]}
        scored = httpx.post(base + path, json=body).json()
        assert scored["id"].startswith("score-")
        assert set(scored["usage"]) == {
            "prompt_tokens",
            "total_tokens",
            "completion_tokens",
            "prompt_tokens_details",
            "completion_tokens_details",
        }
        assert [d["object"] for d in scored["data"]] == ["score", "score"]
        assert scored["data"][0]["score"] == pytest.approx(1.0)  # cosine of a text with itself
        assert scored["data"][1]["score"] < 1.0
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"query": "a cat", "documents": ["a dog", "a cat", "a cow"], "top_n": 2}
        ranked = httpx.post(base + path, json=body).json()
        assert ranked["results"][0]["index"] == 1  # itself first
        assert len(ranked["results"]) == 2 and set(ranked["usage"]) == {
            "prompt_tokens",
            "total_tokens",
        }
    bad = httpx.post(base + "/score", json={"queries": ["a", "b"], "documents": ["a", "b", "c"]})
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == "Input lengths must be either 1:1, 1:N or N:N"
    for path in ("/v1/embeddings", "/pooling"):
        salted = httpx.post(base + path, json={"input": "x", "cache_salt": "a/b"})
        assert salted.status_code == 400 and salted.json()["error"]["param"] == "cache_salt"
    unknown = httpx.post(base + "/v1/embeddings", json={"input": "x", "model": "other"})
    assert unknown.status_code == 404 and unknown.json() == {  # as a real vLLM 0.32 says it
        "error": {
            "message": "The model `other` does not exist.",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }


def test_runner_routes(server: tuple[str, FastAPI]) -> None:
    base = server[0]
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/classify",
    ):
        r = httpx.post(base + path, json={})
        assert (r.status_code, r.json()) == (404, NOT_FOUND), path
    assert httpx.post(base + "/tokenize", json={"prompt": "x"}).status_code == 200


async def test_generate_runner_lacks_pooling_routes() -> None:
    async with running_app(EmulatorSettings(time_scale=0.02)) as (_, client):
        for path in ("/v1/embeddings", "/pooling", "/score", "/rerank", "/v1/audio/transcriptions"):
            r = await client.post(path, json={})
            assert (r.status_code, r.json()) == (404, NOT_FOUND), path


async def test_classify_runner() -> None:
    async with running_app(
        EmulatorSettings(time_scale=0.02, runner="pooling", convert="classify")
    ) as (_, c):
        out = (await c.post("/classify", json={"input": ["good", "bad"]})).json()
        assert out["id"].startswith("classify-")
        for item in out["data"]:
            assert item["num_classes"] == 1 and 0 < item["probs"][0] < 1
        assert (await c.post("/v1/embeddings", json={"input": "x"})).status_code == 404
        scored = (await c.post("/score", json={"queries": "q", "documents": ["a", "b"]})).json()
        assert all(0 < d["score"] < 1 for d in scored["data"])


def test_transcription() -> None:
    audio = bytes(range(256)) * 500  # 128,000 bytes: 4 s at 16 kHz 16-bit mono
    with serve(EmulatorSettings(model="whisper", time_scale=0.02, transcription=True)) as (base, _):
        with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as client:
            first = client.audio.transcriptions.create(model="whisper", file=("a.wav", audio))
            again = client.audio.transcriptions.create(model="whisper", file=("a.wav", audio))
            other = client.audio.transcriptions.create(model="whisper", file=("b.wav", audio[1:]))
        assert first.text and first.text == again.text != other.text
        assert len(first.text.split()) == 10  # 2.5 words a second
        raw = httpx.post(base + "/v1/audio/transcriptions", files={"file": ("a.wav", audio)}).json()
        assert raw["usage"] == {"type": "duration", "seconds": 4}
        moved = httpx.post(base + "/v1/audio/translations", files={"file": ("a.wav", audio)})
        assert moved.json() == {"text": first.text}
        assert (
            httpx.post(base + "/v1/audio/transcriptions", data={"model": "whisper"}).status_code
            == 400
        )
