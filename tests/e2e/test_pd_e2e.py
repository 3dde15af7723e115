"""Disaggregated prefill/decode end to end: gateway, prefill and decode emulators, openai.

Issue 14's reproduction: ``kvgate serve --prefill P1 --prefill P2 --decode D1 --decode D2``
in front of ``kvgate emulate --role prefill|decode``; twelve ~1,000-token chat requests
(a shared system prompt and a question of 10-340 words) one after another, then eight cold
~3,000-token prompts, streamed and not. Legs are counted on the engines themselves, from
the series real vLLM exports (``vllm:request_success_total`` per engine: a prefill leg is
a request on a prefill engine; ``vllm:nixl_xfer_time_seconds_count``: KV pulls on a
decode engine), and every expected P/D mode follows from the rule of
``docs/disaggregation.md``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from procs import MODEL, Cluster, pd_cluster

from gateway.config import PolicyConfig
from tests.promtext import sample_sum

pytestmark = pytest.mark.e2e

DEFAULT_POLICY = PolicyConfig().name  # the default of `kvgate serve` (changes with issue 13)
SYSTEM = "You are the support assistant of a fleet of inference engines. Be precise. " * 36
WORDS = ("how", "does", "the", "router", "place", "my", "request", "when", "its", "prefix")
DOC = "Disaggregated serving splits prefill and decode across engines. " * 40


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {
        "requests": sample_sum(text, "vllm:request_success_total"),
        "pulls": sample_sum(text, "vllm:nixl_xfer_time_seconds_count"),
        "pulled_tokens": sample_sum(
            text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        ),
    }


def snapshot(c: Cluster) -> list[dict[str, float]]:
    return [counters(e.url) for e in c.engines]


def delta(c: Cluster, before: list[dict[str, float]], key: str) -> list[int]:
    return [round(a[key] - b[key]) for a, b in zip(snapshot(c), before, strict=True)]


def decisions(c: Cluster) -> dict[str, float]:
    text = httpx.get(c.gateway.url + "/metrics").text
    reasons = ("remote_long", "remote_uncached", "local_cached", "local_short", "local_saturated")
    return {r: sample_sum(text, "kvgate_pd_decisions_total", reason=r) for r in reasons}


def done_lines(c: Cluster, n: int) -> list[dict[str, object]]:
    """The gateway's last ``n`` "request done" log lines (written by a background thread)."""
    deadline = time.monotonic() + 5
    while True:
        lines = [json.loads(x) for x in c.gateway.output().splitlines() if x.startswith("{")]
        done = [x for x in lines if x.get("msg") == "request done"]
        if len(done) >= n or time.monotonic() > deadline:
            return done[-n:]
        time.sleep(0.05)


IDLE = (
    "kvgate_engine_in_flight",
    "kvgate_engine_pending_prefill_tokens",
    "kvgate_engine_waiting_requests",
    "kvgate_engine_running_requests",
)


def wait_idle(c: Cluster, limit_s: float = 20.0) -> None:
    """Until the gateway's view (its scrapes and its own counts) shows every engine idle."""
    deadline = time.monotonic() + limit_s
    while True:
        text = httpx.get(c.gateway.url + "/metrics").text
        busy = {name: sample_sum(text, name) for name in IDLE}
        if not any(busy.values()):
            return
        assert time.monotonic() < deadline, busy
        time.sleep(0.05)


def ask(oa: OpenAI, messages: list[dict[str, str]] | None, prompt: str | None, stream: bool) -> str:
    if messages is not None:
        if stream:
            chunks = oa.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=8,
                stream=True,  # type: ignore[arg-type]
            )
            return "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
        chat = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)  # type: ignore[arg-type]
        return chat.choices[0].message.content or ""
    assert prompt is not None
    if stream:
        pieces = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True)
        return "".join(p.choices[0].text for p in pieces if p.choices)
    return oa.completions.create(model=MODEL, prompt=prompt, max_tokens=8).choices[0].text


@pytest.fixture(
    scope="module", params=sorted({"cost_model", DEFAULT_POLICY, "least_loaded", "round_robin"})
)
def pd(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Cluster]]:
    with pd_cluster(tmp_path_factory.mktemp("pd"), 2, 2, policy=request.param) as c:
        yield request.param, c


def test_issue_14_scenario_counts_legs_on_each_engine(pd: tuple[str, Cluster]) -> None:
    policy, c = pd
    p_engines, d_engines = c.engines[:2], c.engines[2:]
    oa = OpenAI(base_url=c.gateway.url + "/v1", api_key="x", max_retries=0, timeout=60)
    rnd = random.Random(14)
    before, reasons0 = snapshot(c), decisions(c)
    for i in range(12):  # one after another; streamed and not
        question = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(10, 340)))
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        assert ask(oa, messages, None, stream=i % 2 == 0)
    chat_prefill = delta(c, before, "requests")[:2]
    chat_decode = delta(c, before, "requests")[2:]
    chat_pulls = delta(c, before, "pulls")[2:]
    chat_reasons = {k: v - reasons0[k] for k, v in decisions(c).items()}
    before, reasons0 = snapshot(c), decisions(c)
    for i in range(8):
        doc = " ".join(f"{rnd.random():.6f}" for _ in range(1500))  # ~3,000 cold tokens
        assert ask(oa, None, doc, stream=i % 2 == 1)
    cold_prefill = delta(c, before, "requests")[:2]
    cold_decode = delta(c, before, "requests")[2:]
    cold_pulls = delta(c, before, "pulls")[2:]
    cold_pulled = delta(c, before, "pulled_tokens")[2:]
    cold_reasons = {k: v - reasons0[k] for k, v in decisions(c).items()}

    assert sum(chat_decode) == 12 and sum(cold_decode) == 8
    # cold ~3,000-token prompts: always the prefill pool (remote_long), both engines of it
    assert cold_reasons["remote_long"] == 8 and sum(cold_prefill) == 8 == sum(cold_pulls)
    assert sum(cold_pulled) > 8 * 2900  # each decode leg loaded the whole prompt's KV
    if policy in ("least_loaded", "round_robin"):  # no cache: every chat prompt is "uncached"
        assert chat_reasons["remote_uncached"] == 12 and sum(chat_prefill) == 12
        assert min(chat_prefill) >= 5 and min(chat_decode) >= 5 and min(cold_prefill) >= 3
    if policy == "round_robin":
        assert chat_prefill == [6, 6] and chat_decode == [6, 6] and cold_prefill == [4, 4]
    if policy not in ("least_loaded", "round_robin"):
        # the first chat request is cold (remote); the others find the system prompt on
        # the decode engine that loaded it: 70-80 % cached, prefilled there (local_cached)
        assert chat_reasons["remote_uncached"] == 1 and chat_reasons["local_cached"] == 11
        assert sum(chat_prefill) == 1 == sum(chat_pulls)
        assert sorted(chat_decode) == [0, 12]  # the reuse pays: one decode engine
    if policy == "cost_model":  # both pools balanced: equal cold requests alternate
        assert cold_prefill == [4, 4] and cold_decode == [4, 4]
    # each request's log line names its prefill engine (or `local`) and the reason
    logged = done_lines(c, 20)
    by_prefill = Counter(str(x["prefill"]) for x in logged)
    legs = [a + b for a, b in zip(chat_prefill, cold_prefill, strict=True)]
    expected = {e.url: n for e, n in zip(p_engines, legs, strict=True) if n}
    if sum(chat_prefill) < 12:
        expected["local"] = 12 - sum(chat_prefill)
    assert by_prefill == expected
    assert {x["engine"] for x in logged} <= {e.url for e in d_engines}
    assert Counter(str(x["pd_reason"]) for x in logged)["remote_long"] == 8


def test_sequential_cold_prompts_use_both_decode_engines(pd: tuple[str, Cluster]) -> None:
    """Issue 21: eight cold ~3,000-token prompts one after another, each answered before the
    next is sent (the engines look alike to every scrape): no reuse pays on a decode engine,
    so both decode engines serve them (4/4, 3/5 at worst), and both prefill engines."""
    _, c = pd
    oa = OpenAI(base_url=c.gateway.url + "/v1", api_key="x", max_retries=0, timeout=60)
    rnd = random.Random(21)
    before = snapshot(c)
    for i in range(8):
        doc = " ".join(f"{rnd.random():.6f}" for _ in range(1500))
        wait_idle(c)  # a scrape taken mid-request must not make one engine look busy
        assert ask(oa, None, doc, stream=i % 2 == 0)
    legs = delta(c, before, "requests")
    prefill, decode = legs[:2], legs[2:]
    assert sum(decode) == 8 and min(decode) >= 3, decode
    assert sum(prefill) == 8 == sum(delta(c, before, "pulls")[2:]) and min(prefill) >= 3, prefill


def test_chat_stream_and_completion_go_through_both_legs(pd: tuple[str, Cluster]) -> None:
    _, c = pd
    oa = OpenAI(base_url=c.gateway.url + "/v1", api_key="x", max_retries=0, timeout=60)
    before = sum(counters(e.url)["pulled_tokens"] for e in c.engines[2:])
    remote0 = sample_sum(httpx.get(c.gateway.url + "/metrics").text, "kvgate_pd_requests_total")
    stream = oa.chat.completions.create(
        model=MODEL,
        stream=True,
        max_tokens=16,
        messages=[{"role": "system", "content": DOC}, {"role": "user", "content": "summary?"}],
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    r = oa.completions.with_raw_response.create(
        model=MODEL, prompt=DOC + " once more", max_tokens=8
    )
    assert r.parse().choices[0].text
    assert r.headers["x-kvgate-engine"] in {e.url for e in c.engines[2:]}  # a decode engine
    after = sum(counters(e.url)["pulled_tokens"] for e in c.engines[2:])
    metrics = httpx.get(c.gateway.url + "/metrics").text
    # two cold ~600-token prompts (no common prefix: chat template vs raw text): the rule
    # sends both to the prefill pool (uncached 100 % >= 70 %), whatever the policy
    assert after - before > 2 * 600  # both prompts' KV came from a prefill engine
    assert sample_sum(metrics, "kvgate_pd_requests_total") - remote0 == 2
    assert sample_sum(metrics, "kvgate_pd_requests_total", mode="local") == sample_sum(
        metrics, "kvgate_pd_decisions_total", reason="local_cached"
    )


def test_losing_the_prefill_engine_falls_back_to_local_prefill(tmp_path: Path) -> None:
    with pd_cluster(tmp_path, 1, 2, policy="round_robin") as c:
        c.engines[0].kill()
        oa = AsyncOpenAI(base_url=c.gateway.url + "/v1", api_key="x", max_retries=0, timeout=60)

        async def one(i: int) -> str:
            r = await oa.completions.create(model=MODEL, prompt=f"{i} " + DOC, max_tokens=4)
            return r.choices[0].text

        texts = asyncio.run(_gather(one, 6))
        assert all(texts)
        metrics = httpx.get(c.gateway.url + "/metrics").text
        # the first legs fail (fallback) until the engine is out of routing; then there is
        # no prefill pool and every request is prefilled locally (local_no_prefill)
        fallback = sample_sum(metrics, "kvgate_pd_requests_total", mode="fallback")
        local = sample_sum(metrics, "kvgate_pd_requests_total", mode="local")
        unified = sample_sum(metrics, "kvgate_pd_requests_total", mode="unified")
        assert fallback >= 1 and fallback + local + unified == 6


def test_losing_a_decode_engine_retries_on_the_other(tmp_path: Path) -> None:
    with pd_cluster(tmp_path, 1, 2, policy="round_robin") as c:
        c.engines[1].kill()
        oa = OpenAI(base_url=c.gateway.url + "/v1", api_key="x", max_retries=0, timeout=60)
        served = {
            oa.completions.with_raw_response.create(
                model=MODEL, prompt=f"{i} " + DOC, max_tokens=4
            ).headers["x-kvgate-engine"]
            for i in range(4)
        }
        assert served == {c.engines[2].url}


async def _gather(fn, n: int) -> list[str]:  # type: ignore[no-untyped-def]
    return list(await asyncio.gather(*(fn(i) for i in range(n))))
