"""Hostile and odd requests through the whole gateway app (in process, fake engines).

Decisions documented in docs/security.md:
- bodies larger than ``max_body_bytes`` get 413 (declared or streamed), before routing;
- nesting deeper than 128 levels, invalid UTF-8 and numbers beyond 64 bits are 400s;
- ``max_tokens`` up to 2^63 - 1 goes to the engine (which answers for what it cannot do,
  and its 400 is relayed); beyond, a 400 from kvgate;
- ``n > 1`` is passed through (vLLM serves it; the emulator answers 400, relayed);
- fields kvgate does not read reach the engine byte for byte; ``kv_transfer_params``
  (an engine-to-engine address) is refused.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fake_engines import FakeEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inproc_gateway import A, client_of, gateway, running_app
from test_fuzz_parsing import bodies, json_values

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def assert_openai_error(r: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["type"], str) and err["type"]
    for word in words:
        assert word in err["message"], err
    return dict(err)


# -- property: whatever the body, a clean answer --------------------------------------
class _Loop:
    """One app on its own event loop for a whole hypothesis run (module scope)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = FakeEngine(A)
        self._app_cm = running_app(self.engine)
        app = self.loop.run_until_complete(self._app_cm.__aenter__())
        self.client = client_of(app)

    def post(self, path: str, raw: bytes) -> httpx.Response:
        return self.loop.run_until_complete(
            self.client.post(path, content=raw, headers={"content-type": "application/json"})
        )

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self._app_cm.__aexit__(None, None, None))
        self.loop.close()


@pytest.fixture(scope="module")
def app_loop() -> Iterator[_Loop]:
    runner = _Loop()
    yield runner
    runner.close()


@settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(body=bodies | json_values, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_any_body_gets_a_clean_answer(app_loop: _Loop, body: Any, path: str) -> None:
    raw = json.dumps(body).encode()
    before = len(app_loop.engine.raw)
    r = app_loop.post(path, raw)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code == 200:
        assert app_loop.engine.raw[-1] == raw  # forwarded byte for byte
    else:
        assert_openai_error(r, r.status_code)
        assert len(app_loop.engine.raw) == before  # nothing invalid is forwarded


# -- explicit cases ---------------------------------------------------------------------
@pytest.fixture
async def engine_and_gw() -> AsyncIterator[tuple[FakeEngine, httpx.AsyncClient]]:
    a = FakeEngine(A)
    async with gateway(a, max_body_bytes=4096) as gw:
        yield a, gw


async def test_oversized_body_is_413_declared_or_streamed(
    engine_and_gw: tuple[FakeEngine, httpx.AsyncClient],
) -> None:
    a, gw = engine_and_gw
    big = json.dumps({"model": "m", "prompt": "x" * 10_000}).encode()
    declared = await gw.post("/v1/completions", content=big)

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    streamed = await gw.post("/v1/completions", content=chunks())
    assert_openai_error(declared, 413, "larger than 4096")
    assert_openai_error(streamed, 413, "larger than 4096")
    bad_length = await gw.post("/v1/completions", content=b"{}", headers={"content-length": "nope"})
    assert bad_length.status_code == 400
    assert a.seen == []


@pytest.mark.parametrize("depth", [129, 1_000, 100_000])
async def test_deep_nesting_is_a_clean_400(depth: int) -> None:
    a = FakeEngine(A)
    async with gateway(a) as gw:
        arrays = await gw.post("/v1/completions", content=b"[" * depth + b"]" * depth)
        inside = await gw.post(
            "/v1/chat/completions",
            content=b'{"model":"m","messages":[{"role":"user","content":"x"}],"x":'
            + b"[" * depth
            + b"]" * depth
            + b"}",
        )
    assert_openai_error(arrays, 400)  # too deep, or (within Python's limit) not an object
    assert_openai_error(inside, 400, "nested too deeply")
    assert a.seen == []


async def test_nesting_within_the_limit_is_forwarded_unchanged() -> None:
    a = FakeEngine(A)
    raw = b'{"model":"m","prompt":"x","tool_schema":' + b'{"a":' * 100 + b"1" + b"}" * 100 + b"}"
    async with gateway(a) as gw:
        r = await gw.post("/v1/completions", content=raw)
    assert r.status_code == 200 and a.raw == [raw]


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xfe{}", b'{"model":"m","prompt":"\xc3\x28"}', b'{"model":"m","prompt":"\xed\xa0\x80"}'],
)
async def test_invalid_utf8_is_400(raw: bytes) -> None:
    a = FakeEngine(A)
    async with gateway(a) as gw:
        r = await gw.post("/v1/completions", content=raw)
    assert_openai_error(r, 400, "UTF-8")
    assert a.seen == []


async def test_huge_numbers() -> None:
    a = FakeEngine(A)
    async with gateway(a) as gw:
        beyond = await gw.post(
            "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2**63}
        )
        digits = await gw.post(
            "/v1/completions",
            content=b'{"model":"m","prompt":"x","max_tokens":' + b"9" * 5000 + b"}",
        )
        tokens = await gw.post("/v1/completions", json={"model": "m", "prompt": [1, 2**64]})
        negative = await gw.post("/v1/completions", json={"model": "m", "prompt": [[1], [-1]]})
        large = await gw.post(
            "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2**63 - 1}
        )
    assert_openai_error(beyond, 400, "max_tokens")
    assert_openai_error(digits, 400, "too many digits")
    assert_openai_error(tokens, 400, "token ids")
    assert_openai_error(negative, 400, "token ids")
    assert large.status_code == 200  # the engine decides what it can serve
    assert a.seen == [{"model": "m", "prompt": "x", "max_tokens": 2**63 - 1}]


async def test_engine_400_for_huge_max_tokens_is_relayed() -> None:
    a = FakeEngine(A, mode="status400")
    async with gateway(a) as gw:
        r = await gw.post(
            "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 10**12}
        )
    assert_openai_error(r, 400, "fake 400")
    assert len(a.seen) == 1  # not retried


async def test_n_greater_than_one_is_passed_through() -> None:
    a = FakeEngine(A)
    async with gateway(a) as gw:
        ok = await gw.post("/v1/chat/completions", json={**CHAT, "n": 4})
        stream = await gw.post(
            "/v1/completions", json={"model": "m", "prompt": "p", "n": 2, "stream": True}
        )
        too_many = await gw.post("/v1/chat/completions", json={**CHAT, "n": 129})
        zero = await gw.post("/v1/chat/completions", json={**CHAT, "n": 0})
    assert ok.status_code == 200 and stream.status_code == 200
    assert [b.get("n") for b in a.seen] == [4, 2]
    assert_openai_error(too_many, 400, "n:")
    assert_openai_error(zero, 400, "n:")


async def test_unknown_fields_reach_the_engine_byte_for_byte() -> None:
    a = FakeEngine(A)
    raw = (
        b'{ "model" : "m", "messages":[{"role":"user","content":"h\\u00e9llo","x-msg":[1,{}]}],'
        b'"temperature":0.0,"logit_bias":{"50256":-100},"guided_json":{"type":"object"},'
        b'"vendor_ext":{"nested":[null,true,1e400]},"seed":1,"seed":2}'
    )
    async with gateway(a) as gw:
        r = await gw.post("/v1/chat/completions", content=raw)
    assert r.status_code == 200
    assert a.raw == [raw]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat", {**CHAT, "model": 5}, "model"),
        ("chat", {**CHAT, "stream": "yes"}, "stream"),
        ("chat", {**CHAT, "stream": 1}, "stream"),
        ("chat", {**CHAT, "max_tokens": "10"}, "max_tokens"),
        ("chat", {**CHAT, "max_tokens": 1.5}, "max_tokens"),
        ("chat", {**CHAT, "max_tokens": True}, "max_tokens"),
        ("chat", {**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
        ("chat", {**CHAT, "n": "2"}, "n"),
        ("chat", {**CHAT, "stream_options": []}, "stream_options"),
        ("chat", {**CHAT, "tools": {"a": 1}}, "tools"),
        ("chat", {"model": "m", "messages": "hi"}, "messages"),
        ("chat", {"model": "m", "messages": [{"role": 5}]}, "messages.0.role"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": {"a": 1}}]}, "messages"),
        ("chat", {"model": "m", "messages": [{"role": "user", "name": 3}]}, "messages.0.name"),
        ("chat", {**CHAT, "kv_transfer_params": {"remote_host": "10.0.0.1"}}, "kv_transfer_params"),
        ("completions", {"model": "m", "prompt": {"a": 1}}, "prompt"),
        ("completions", {"model": "m", "prompt": [1, "a"]}, "prompt"),
        ("completions", {"model": "m", "prompt": None}, "prompt"),
        ("completions", {"model": "m"}, "prompt"),
    ],
)
async def test_wrong_types_are_400_naming_the_field(
    route: str, body: dict[str, Any], param: str
) -> None:
    a = FakeEngine(A)
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    async with gateway(a) as gw:
        r = await gw.post(path, json=body)
    err = assert_openai_error(r, 400)
    assert err["param"] is not None and err["param"].startswith(param), err
    assert err["type"] == "invalid_request_error"
    assert a.seen == []
