"""End to end: real processes (gateway + emulated engines) and the official openai client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import APIStatusError, AsyncOpenAI, OpenAI
from procs import MODEL, Cluster, cluster

from tests.promtext import sample_sum

pytestmark = pytest.mark.e2e

SYSTEM = "You are kvgate's test assistant. Answer briefly and precisely. " * 30


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("e2e"), n=3) as c:
        yield c


def client(c: Cluster) -> OpenAI:
    return OpenAI(base_url=c.gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_non_stream_and_stream(running: Cluster) -> None:
    oa = client(running)
    msgs = [{"role": "user", "content": "Say something."}]
    r = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)  # type: ignore[arg-type]
    assert r.choices[0].message.content
    assert r.usage is not None and r.usage.completion_tokens <= 12
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=12,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # the emulator is deterministic
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completions_non_stream_and_stream(running: Cluster) -> None:
    oa = client(running)
    r = oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert r.choices[0].text and r.usage is not None
    pieces = list(
        oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True)
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices) == r.choices[0].text


def test_shared_prefix_lands_on_the_engine_that_has_it(running: Cluster) -> None:
    oa = client(running)
    engines, cached = [], []
    for i in range(4):
        raw = oa.chat.completions.with_raw_response.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"question {i}"},
            ],
        )
        engines.append(raw.headers["x-kvgate-engine"])
        usage = raw.parse().usage
        assert usage is not None
        details = usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
    assert len(set(engines)) == 1
    assert cached[0] == 0 or cached[0] is None
    assert all(c and c > 0 for c in cached[1:]), cached


def test_bad_input_is_a_clean_4xx(running: Cluster) -> None:
    oa = client(running)
    with pytest.raises(APIStatusError) as info:
        oa.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.status_code == 404
    r = httpx.post(
        running.gateway.url + "/v1/chat/completions",
        content=b"{oops",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()


def test_client_disconnect_cancels_the_engine_request(tmp_path: Path) -> None:
    # One engine in real time: left alone, the request decodes 2,000 tokens at ~7.5 ms a step
    # (15 s), far longer than the 3 s allowed below for the engine to drop it.
    with cluster(tmp_path, n=1, time_scale=1.0) as c:
        engine = c.engines[0].url
        body = {
            "model": MODEL,
            "prompt": "long story",
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", c.gateway.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.headers["x-kvgate-engine"] == engine
            for _ in r.iter_bytes():
                break  # leave after the first chunk
        deadline = time.monotonic() + 3
        while True:
            text = httpx.get(engine + "/metrics").text
            aborted = sample_sum(text, "vllm:request_success_total", finished_reason="abort")
            running = sample_sum(text, "vllm:num_requests_running")
            if (aborted == 1 and running == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (aborted, running) == (1, 0), "the engine kept running the abandoned request"
        assert sample_sum(text, "vllm:generation_tokens_total") < 500
        assert sample_sum(text, "vllm:request_success_total", finished_reason="length") == 0


async def test_killing_an_engine_loses_no_unstarted_request(tmp_path: Path) -> None:
    with cluster(tmp_path, n=3, policy="round_robin", time_scale=1.0) as c:
        oa = AsyncOpenAI(base_url=c.gateway.url + "/v1", api_key="x", max_retries=0, timeout=60)

        async def one(i: int, tokens: int = 150) -> str:
            r = await oa.completions.with_raw_response.create(
                model=MODEL,
                prompt=f"request {i} " * 20,
                max_tokens=tokens,
                extra_body={"ignore_eos": True},
            )
            assert r.parse().usage.completion_tokens == tokens  # type: ignore[union-attr]
            return r.headers["x-kvgate-engine"]

        tasks = [asyncio.create_task(one(i)) for i in range(12)]
        victim = c.engines[0]
        async with asyncio.timeout(30):  # every request is in flight, some on the victim
            while True:
                async with httpx.AsyncClient() as http:
                    text = (await http.get(c.gateway.url + "/metrics")).text
                flying = sample_sum(text, "kvgate_engine_in_flight")
                if flying == 12 and sample_sum(text, "kvgate_engine_in_flight", engine=victim.url):
                    break
                await asyncio.sleep(0.01)
        victim.kill()
        served = await asyncio.gather(*tasks)
        assert len(served) == 12
        assert victim.url not in served  # its requests were retried elsewhere
        deadline = time.monotonic() + 5
        while True:
            admin = httpx.get(c.gateway.url + "/admin/engines").json()["engines"]
            dead = next(e for e in admin if e["url"] == victim.url)
            if dead["health"] == "unhealthy" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert dead["health"] == "unhealthy"
        later = [await one(100 + i, tokens=4) for i in range(6)]
        assert victim.url not in later
        text = httpx.get(c.gateway.url + "/metrics").text
        assert sample_sum(text, "kvgate_retries_total", route="completions") >= 1
        failed = [
            ln
            for ln in text.splitlines()
            if ln.startswith("kvgate_requests_total")
            and 'outcome="ok"' not in ln
            and not ln.endswith(" 0.0")
        ]
        assert not failed, json.dumps(failed)


def test_held_request_leaves_the_router_queue_when_its_client_leaves(tmp_path: Path) -> None:
    import threading

    with cluster(
        tmp_path,
        n=1,
        policy="dualmap",
        time_scale=5.0,
        gateway_args=["--policy-option", "dispatch_pending_tokens=10"],
    ) as c:
        url = c.gateway.url
        # A long prompt keeps the engine's pending prefill above the dispatch threshold...
        blocker = {"model": MODEL, "prompt": "blocker " * 2000, "max_tokens": 1}
        done: list[int] = []
        thread = threading.Thread(
            target=lambda: done.append(
                httpx.post(url + "/v1/completions", json=blocker, timeout=30).status_code
            )
        )
        thread.start()
        deadline = time.monotonic() + 10  # the blocker is routed: the engine's pending is up
        while not any(
            e["pending_prefill_tokens_est"] > 10
            for e in httpx.get(url + "/admin/engines").json()["engines"]
        ):
            assert time.monotonic() < deadline, "the blocker was never routed"
            time.sleep(0.01)
        # ...so this one is held in the router queue, and its client gives up while held.
        held = {"model": MODEL, "prompt": "held " * 300, "max_tokens": 1}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/completions", json=held, timeout=0.2)
        deadline = time.monotonic() + 5
        while (queue := httpx.get(url + "/admin/engines").json())["router_queued"] and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        # it left the queue while the blocker still kept the engine above the dispatch
        # threshold: dropped (its client gone), not released to the engine
        assert queue["router_queued"] == 0, queue
        assert queue["engines"][0]["pending_prefill_tokens_est"] > 10, queue
        thread.join(timeout=30)
        text = httpx.get(url + "/metrics").text
        admin = httpx.get(url + "/admin/engines").json()
    assert done == [200]
    assert admin["router_queued"] == 0
    held_line = next(ln for ln in text.splitlines() if ln.startswith("kvgate_router_held_total"))
    assert float(held_line.split()[-1]) == 1.0
    assert 'outcome="cancelled"' in text
