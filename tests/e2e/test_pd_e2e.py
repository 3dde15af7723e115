"""Disaggregated prefill/decode end to end: gateway, prefill and decode emulators, openai."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from procs import MODEL, Cluster, pd_cluster

pytestmark = pytest.mark.e2e

DOC = "Disaggregated serving splits prefill and decode across engines. " * 40


def loaded_tokens(engine_url: str) -> float:
    text = httpx.get(engine_url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total")
        and 'source="external_kv_transfer"' in line
    )


@pytest.fixture(scope="module", params=["cost_model", "round_robin"])
def pd(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Cluster]]:
    with pd_cluster(tmp_path_factory.mktemp("pd"), 1, 2, policy=request.param) as c:
        yield request.param, c


def test_chat_stream_and_completion_go_through_both_legs(pd: tuple[str, Cluster]) -> None:
    policy, c = pd
    oa = OpenAI(base_url=c.gateway.url + "/v1", api_key="x", max_retries=0, timeout=60)
    before = sum(loaded_tokens(e.url) for e in c.engines[1:])
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
    assert r.headers["x-kvgate-engine"] in {e.url for e in c.engines[1:]}  # a decode engine
    after = sum(loaded_tokens(e.url) for e in c.engines[1:])
    metrics = httpx.get(c.gateway.url + "/metrics").text
    if policy == "round_robin":
        # single-pool policies always disaggregate prompts with >= 256 uncached tokens
        assert after - before > 2 * 600  # both prompts' KV came from the prefill engine
        assert 'kvgate_pd_requests_total{mode="remote"} 2.0' in metrics
    else:
        # the cost model may prefer a local prefill on an idle decode engine (no transfer)
        assert 'kvgate_pd_requests_total{mode="remote"}' in metrics or 'mode="local"' in metrics


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
        assert 'kvgate_pd_requests_total{mode="fallback"}' in metrics or ('mode="local"' in metrics)


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
