"""Parity on an idle cluster: the simulator and the live gateway make the same decisions.

One small chat trace with shared prefixes goes through the simulator and through
``kvgate serve`` + three ``kvgate emulate`` processes, one request at a time (nothing
in flight, so no timing enters: the simulated arrivals are the live send times, and the
gateway scrapes the engines once, idle, at start, so no scrape lands inside a request
and shows a running request to the next few decisions). Every registered policy
(``policy_names()``) must send every request to the same engine in both; the simulated
engines carry the live engines' ids and both sides price with the same engine preset.
Under load, where timing does enter, see test_parity_under_load.py.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from procs import MODEL, Proc, start_emulator, start_gateway

from gateway.perfmodel.presets import load_preset
from gateway.policies.registry import policy_names
from gateway.proxy.routing_key import RoutingKeyer
from gateway.sim.loop import ClusterSpec
from gateway.sim.runner import run_policy
from gateway.sim.workloads import Workload, WorkloadRequest

pytestmark = pytest.mark.e2e

SYSTEMS = [
    f"System prompt number {k}: you answer questions about topic {k}. " * (8 + 6 * k)
    for k in range(4)
]


def trace() -> list[dict[str, object]]:
    bodies = []
    for i in range(18):
        system = SYSTEMS[(i * 7) % 4 if i % 3 else i % 2]
        bodies.append(
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"question {i}: " + "detail " * (i % 5)},
                ],
            }
        )
    return bodies


PRESET = "llama3-8b-h100"
GAP_S = 0.1
"""Seconds between requests on both sides: each finishes long before the next (the
emulators run 100x faster than modelled), and time-windowed policy state (Preble's
window, TTLs) sees the same clock on both sides."""


def simulated(
    policy: str, bodies: list[dict[str, object]], urls: list[str], sent: list[float]
) -> list[int]:
    keyer = RoutingKeyer(block_size=16, chars_per_token=4.0)
    reqs = []
    for i, body in enumerate(bodies):
        hashes, tokens = keyer.chat_key(body["messages"], None)  # type: ignore[arg-type]
        reqs.append(
            WorkloadRequest(
                id=f"r{i}",
                arrival=sent[i],
                prompt_tokens=tokens,
                output_tokens=4,
                block_hashes=hashes,
            )
        )
    workload = Workload(name="parity", requests=tuple(reqs), block_size=16)
    cluster = ClusterSpec(len(urls), load_preset(PRESET), engine_ids=tuple(urls))
    run = run_policy(policy, workload, cluster)
    return [urls.index(r.engine) for r in run.records]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Proc]]:
    logdir = tmp_path_factory.mktemp("parity")
    procs = [start_emulator(logdir, i, time_scale=0.01) for i in range(3)]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("policy", policy_names())
def test_simulator_and_gateway_make_the_same_decisions(
    policy: str, engines: list[Proc], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bodies = trace()
    urls = [e.url for e in engines]
    monkeypatch.setenv("KVGATE_PRESET", PRESET)  # the engines' model, for policies that price
    monkeypatch.setenv("KVGATE_HEALTH__INTERVAL_S", "600")  # one scrape, before any request
    gateway = start_gateway(tmp_path, urls, policy=policy)
    try:
        live, sent = [], []
        with httpx.Client(timeout=30) as client:
            start = time.monotonic()
            for i, body in enumerate(bodies):
                time.sleep(max(0.0, start + GAP_S * i - time.monotonic()))
                sent.append(time.monotonic() - start)  # late under load: the sim sees it late too
                r = client.post(gateway.url + "/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                live.append(urls.index(r.headers["x-kvgate-engine"]))
    finally:
        gateway.stop()
    expected = simulated(policy, bodies, urls, sent)
    assert live == expected
