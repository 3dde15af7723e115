"""A real vLLM engine killed mid-run behind kvgate: clean errors, no hang, traffic moves on."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import httpx
import openai
import pytest
from conftest import MODEL, Engine, Fleet, start_gateway

from tests.promtext import sample_sum

pytestmark = pytest.mark.vllm

PROMPT = "The router keeps every stream alive while engines come and go. " * 4


def one_stream(url: str) -> str:
    """Stream one long completion; 'ok', or the kind of clean failure the client saw."""
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    try:
        text = ""
        for chunk in oa.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            if chunk.choices:
                text += chunk.choices[0].text or ""
        return "ok" if text else "empty"
    except openai.APIError as exc:
        return f"error: {type(exc).__name__}"


def test_engine_killed_mid_run(fleet: Fleet, victim: Engine, tmp_path: Path) -> None:
    """``victim`` is the fleet's small engine (this test runs after its other users)."""
    survivor = fleet.unified[0]
    gw = None
    try:
        gw = start_gateway(
            tmp_path, ["--policy", "round_robin", "--engine", survivor.url, "--engine", victim.url]
        )
        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(one_stream, gw.url) for _ in range(8)]
            deadline = time.monotonic() + 30
            while victim.metric("vllm:num_requests_running") < 1:
                assert time.monotonic() < deadline, "no request ever reached the victim"
                time.sleep(0.05)
            victim.kill()  # SIGKILL to the engine's whole process group, streams in flight
            done, hung = wait(futures, timeout=90)
        assert not hung, "requests hung after the engine died"
        outcomes = [f.result() for f in done]
        # The streams on the survivor finish; the ones cut on the victim end with a clean
        # OpenAI-style error event (the client raises APIError), never a hang or garbage.
        assert outcomes.count("ok") >= 4, outcomes
        assert any(o.startswith("error") for o in outcomes), outcomes
        assert all(o == "ok" or o.startswith("error: API") for o in outcomes), outcomes

        # New traffic goes to the survivor: nothing fails once the gateway has noticed.
        oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=60)
        for i in range(6):
            r = oa.completions.create(model=MODEL, prompt=f"after the crash {i}", max_tokens=4)
            assert r.choices[0].text is not None
        engines = httpx.get(gw.url + "/admin/engines", timeout=10).json()["engines"]
        state = {e["url"]: e for e in engines}
        assert not state[victim.url]["routable"] and state[survivor.url]["routable"]
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        assert sample_sum(metrics, "kvgate_engine_errors_total", engine=victim.url) >= 1
    finally:
        if gw is not None:
            gw.stop()
