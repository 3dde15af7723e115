"""The endpoints beyond chat and completions through kvgate, in front of real vLLM.

The official clients against kvgate: the ``openai`` SDK's Responses API (two-turn
conversations with ``previous_response_id`` over 2 engines, stream and not, each
follow-up on the engine that stored turn one), the ``anthropic`` SDK (stream and not,
and its error shape), embeddings from an engine started with the pooling runner, and
``/tokenize``. The gateway routes round robin, so a follow-up that is not pinned lands
on the other engine (the store is per process: vLLM answers it 404).
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import pytest
from conftest import EMBED_MODEL, MODEL, Engine, Fleet, Gateway, start_gateway
from openai import OpenAI

pytestmark = pytest.mark.vllm

CONVERSATIONS = 4  # round robin: turn ones land on both engines
DONE = ("completed", "incomplete")  # incomplete: max_output_tokens reached (a random model)


@pytest.fixture(scope="module")
def gateway(
    fleet: Fleet, pooling_engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    args = ["--policy", "round_robin"]
    for e in [*fleet.unified, pooling_engine]:
        args += ["--engine", e.url]
    gw = start_gateway(tmp_path_factory.mktemp("gw-endpoints"), args)
    try:
        yield gw
    finally:
        gw.stop()


def openai_client(gw: Gateway) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_responses_follow_ups_reach_the_engine_that_stored_turn_one(
    fleet: Fleet, gateway: Gateway
) -> None:
    """All first turns, then all follow-ups: round robin alone would send half the
    follow-ups to the engine that does not store their first turn."""
    oa = openai_client(gateway)
    firsts = []
    for i in range(CONVERSATIONS):
        raw = oa.responses.with_raw_response.create(
            model=MODEL, input=f"conversation {i}: tell me about caches", max_output_tokens=8
        )
        first = raw.parse()
        assert first.status in DONE and first.usage is not None
        firsts.append((first, raw.headers["x-kvgate-engine"]))
    assert {engine for _, engine in firsts} == {e.url for e in fleet.unified}
    for first, engine in firsts:
        raw2 = oa.responses.with_raw_response.create(
            model=MODEL, previous_response_id=first.id, input="and then?", max_output_tokens=8
        )
        second = raw2.parse()
        assert raw2.headers["x-kvgate-engine"] == engine
        assert second.previous_response_id == first.id
        assert first.usage is not None and second.usage is not None
        assert second.usage.input_tokens > first.usage.input_tokens  # turn one is in it
        got = httpx.get(f"{gateway.url}/v1/responses/{second.id}", timeout=30)
        assert got.status_code == 200 and got.json()["id"] == second.id
        assert got.headers["x-kvgate-engine"] == engine


def _streamed_turn(oa: OpenAI, text: str, previous: str | None) -> tuple[str, str]:
    """One streamed Responses turn: (the response id, the engine that served it)."""
    extra = {"previous_response_id": previous} if previous else {}
    with oa.responses.with_streaming_response.create(
        model=MODEL, input=text, max_output_tokens=8, stream=True, **extra
    ) as raw:
        engine = raw.headers["x-kvgate-engine"]
        events = list(raw.parse())
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    ), kinds
    done = events[-1].response  # type: ignore[union-attr]
    assert done.status in DONE
    if previous is not None:
        assert done.previous_response_id == previous
    return done.id, engine


def test_streamed_responses_follow_ups_reach_the_engine_that_stored_turn_one(
    fleet: Fleet, gateway: Gateway
) -> None:
    oa = openai_client(gateway)
    firsts = [_streamed_turn(oa, f"streamed conversation {i}: hello", None) for i in range(4)]
    assert {engine for _, engine in firsts} == {e.url for e in fleet.unified}
    for first_id, engine in firsts:
        _, follow_up_engine = _streamed_turn(oa, "go on", first_id)
        assert follow_up_engine == engine


def test_the_anthropic_sdk_through_kvgate(gateway: Gateway) -> None:
    client = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0, timeout=120)
    msgs: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Say hi."}]
    m = client.messages.create(model=MODEL, max_tokens=8, messages=msgs, system="Be brief.")
    assert m.type == "message" and m.role == "assistant"
    assert m.content and m.content[0].type == "text"
    assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=8, messages=msgs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.output_tokens > 0
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="no-such-model", max_tokens=8, messages=msgs)
    assert err.value.body is not None and err.value.body.get("type") == "error"  # type: ignore[union-attr]


def test_embeddings_come_from_the_pooling_engine(gateway: Gateway, pooling_engine: Engine) -> None:
    oa = openai_client(gateway)
    raw = oa.embeddings.with_raw_response.create(model=EMBED_MODEL, input=["a cache", "a router"])
    assert raw.headers["x-kvgate-engine"] == pooling_engine.url
    vectors = [d.embedding for d in raw.parse().data]
    assert len(vectors) == 2 and len(vectors[0]) == len(vectors[1]) > 0
    assert vectors[0] != vectors[1]


def test_tokenize_through_kvgate_is_the_engines(fleet: Fleet, gateway: Gateway) -> None:
    for body in (
        {"model": MODEL, "prompt": "the router keeps the prefix hot"},
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "add_generation_prompt": True,
        },
    ):
        via = httpx.post(gateway.url + "/tokenize", json=body, timeout=30)
        assert via.status_code == 200, via.text
        direct = httpx.post(fleet.unified[0].url + "/tokenize", json=body, timeout=30)
        assert via.json()["tokens"] == direct.json()["tokens"] and via.json()["count"] > 3
