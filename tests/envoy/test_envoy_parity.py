"""Parity: on the same arrivals, ``kvgate epp`` behind real Envoy and ``kvgate serve`` make the
same decisions, in both body modes.

The same 18 requests (completions and chat, streamed and not, three shared prefixes and unique
prompts) go one at a time through ``kvgate serve`` and through Envoy + ``kvgate epp``, each run
in front of fresh emulated engines, both front ends recording (``record``: one line per
request with its block hashes salted by one shared salt, its model, route and engine) and each
request waited for until the front end has closed it (``kvgate_engine_in_flight`` back to 0),
with the engines' metrics scraped once at start: every decision then sees the same view. The
recordings must agree line by line: the same routing key (salted hash ids), model and route,
and the same engine (by position); and each request settled alike: the same outcome and
the same usage-derived lengths and their sources. ``kvgate serve``'s decision log (``decision_log``)
replays to the same answers through a fresh policy, so the shared decisions are the policy's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI

from gateway.cli.demo import free_port
from gateway.policies.recording import Call, replay
from gateway.policies.recording_codec import decode_call, decode_spec
from tests.e2e.procs import MODEL, Proc, start, start_emulator, wait_for
from tests.envoy.rig import FRONTENDS, MODES, start_envoy, start_epp, wait
from tests.promtext import sample_sum

pytestmark = [pytest.mark.envoy, pytest.mark.e2e]

POLICY = "cache_aware"
ENGINES = 3
PREFIXES = [
    "Parity prefix A: the ledger steward reconciles invoices and flags duplicates. " * 12,
    "Parity prefix B: meteorology handbook, fronts, pressure and cumulonimbus. " * 12,
    "Parity prefix C: a field guide to alpine flowers and where they grow. " * 12,
]
EPP_FLAGS = ["--fallbacks", "0"]


@dataclass(frozen=True)
class Arrival:
    chat: bool
    stream: bool
    text: str


def arrivals() -> list[Arrival]:
    out = []
    for i in range(18):
        shared = i % 6 != 5
        text = f"{PREFIXES[i % 3]} question {i}: continue." if shared else f"unique prompt {i}"
        out.append(Arrival(chat=i % 4 >= 2, stream=i % 2 == 1, text=text))
    return out


def send(oa: OpenAI, a: Arrival) -> None:
    if a.chat:
        msgs: Any = [{"role": "user", "content": a.text}]
        if a.stream:
            list(oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, stream=True))
        else:
            oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    elif a.stream:
        list(oa.completions.create(model=MODEL, prompt=a.text, max_tokens=4, stream=True))
    else:
        oa.completions.create(model=MODEL, prompt=a.text, max_tokens=4)


def in_flight(metrics_url: str) -> float:
    with httpx.Client(timeout=5) as client:
        return sample_sum(client.get(metrics_url + "/metrics").text, "kvgate_engine_in_flight")


@dataclass
class Run:
    urls: list[str]
    lines: list[dict[str, Any]]
    decision_log: tuple[dict[str, Any], list[Call]] | None


def fetch_log(url: str) -> tuple[dict[str, Any], list[Call]]:
    calls: list[Call] = []
    with httpx.Client(timeout=30) as client:
        while True:
            r = client.get(url + "/admin/decisions", params={"offset": len(calls), "limit": 5000})
            assert r.status_code == 200, r.text
            page = r.json()
            assert not page["truncated"]
            calls += [decode_call(c) for c in page["calls"]]
            if len(calls) >= page["total"] or not page["calls"]:
                return page["spec"], calls


def run(logdir: Path, front: str, frontend: str = "python") -> Run:
    """The arrivals through ``front`` ("serve" or an Envoy body mode, the picker's ext_proc
    served by ``frontend``) on fresh engines."""
    ports = [free_port() for _ in range(ENGINES)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    record = logdir / f"{front}.jsonl"
    settings = {
        "engines": [{"url": u} for u in urls],
        # a miss goes to the engine with the smallest tree: the prefixes spread over engines
        "policy": {"name": POLICY, "options": {"miss": "smallest_tree"}},
        "record": {"path": str(record), "salt": "envoy-parity"},
        "decision_log": {"enabled": True},
        "log_requests": False,
        "health": {"interval_s": 3600, "models_refresh_s": 3600},  # scraped once, at start
    }
    config = logdir / f"{front}.yaml"
    config.write_text(yaml.safe_dump(settings), encoding="utf-8")
    procs: list[Proc] = []
    try:
        procs += [start_emulator(logdir, i, port=p, name=f"{front}-engine{i}", wait=False)
                  for i, p in enumerate(ports)]  # fmt: skip
        for e in procs[:ENGINES]:  # bound before the front end picks its free ports
            wait_for(e, "/health", timeout=300)
        if front == "serve":
            port = free_port()
            gw = start(["serve", "--port", str(port), "--config", str(config)], "serve", port,
                       logdir)  # fmt: skip
            procs.append(gw)
            wait_for(gw, "/ready", timeout=300)
            base = metrics = gw.url
        else:
            epp, grpc = start_epp(logdir, [], policy=POLICY, config=config, name=f"epp-{front}",
                                  extra=["--log-level", "warning", "--frontend", frontend,
                                         *EPP_FLAGS])  # fmt: skip
            procs.append(epp)
            envoy = start_envoy(logdir, front, grpc, name=f"envoy-{front}")
            procs.append(envoy.proc)
            wait(envoy.epp_healthy, 300, "Envoy sees the picker healthy", epp)
            base, metrics = envoy.url, epp.url
        oa = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        for a in arrivals():
            send(oa, a)
            deadline = time.monotonic() + 30
            while in_flight(metrics) > 0:  # closed by the front end, not just by the client
                assert time.monotonic() < deadline, "a request was never closed"
                time.sleep(0.01)
        log = fetch_log(base) if front == "serve" else None
    finally:
        for p in reversed(procs):
            p.stop()  # the recorder flushes on shutdown
    lines = [json.loads(x) for x in record.read_text(encoding="utf-8").splitlines()]
    return Run(urls, lines, log)


@pytest.fixture(scope="module")
def serve_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run(tmp_path_factory.mktemp("parity-serve"), "serve")


@pytest.fixture(scope="module", params=[(m, f) for m in sorted(MODES) for f in FRONTENDS],
                ids="-".join)  # fmt: skip
def epp_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    mode, frontend = request.param
    return run(tmp_path_factory.mktemp(f"parity-{mode}-{frontend}"), mode, frontend)


def decisions(r: Run) -> list[tuple[Any, ...]]:
    """Per request, in arrival order: its routing key (salted block hashes), model, route, and
    the engine (by position) it was sent to. (Token counts and outcomes are the response's
    accounting: :func:`accounting` compares them.)"""
    return [
        (tuple(x["hash_ids"]), x["model"], x["route"], r.urls.index(x["engine"]))
        for x in sorted(r.lines, key=lambda x: x["timestamp"])
    ]


def test_epp_and_serve_decide_alike(serve_run: Run, epp_run: Run) -> None:
    a, b = decisions(serve_run), decisions(epp_run)
    assert len(a) == len(b) == len(arrivals())
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x[:3] == y[:3], f"request {i}: routing keys or routes differ: {x[:3]} / {y[:3]}"
        assert x[3] == y[3], f"request {i}: serve chose engine {x[3]}, epp {y[3]}"
    assert len({x[3] for x in a}) >= 2  # the arrivals do spread over the engines
    assert sum(1 for x in a if x[0]) >= 15  # and carry routing keys (all but the 3 short)


ACCOUNTING = ("ok", "outcome", "input_source", "input_length", "output_source", "output_length")
"""What each request's response settled: its outcome and the usage-derived lengths."""


def accounting(r: Run) -> list[tuple[Any, ...]]:
    return [tuple(x[k] for k in ACCOUNTING) for x in sorted(r.lines, key=lambda x: x["timestamp"])]


def test_epp_and_serve_settle_alike(serve_run: Run, epp_run: Run) -> None:
    """Every request is closed as ``kvgate serve`` closes it: the same outcome (``ok``, not
    ``cancelled`` by the stream's close) and lengths from the engine's usage where serve's
    are (the response's end read before Envoy closes the stream)."""
    a, b = accounting(serve_run), accounting(epp_run)
    assert len(a) == len(b) == len(arrivals())
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        named = dict(zip(ACCOUNTING, x, strict=True))
        assert x == y, f"request {i}: serve settled {named}, epp {y}"
    assert all(x[1] == "ok" for x in a)
    assert sum(1 for x in a if x[2] == "usage") >= 9  # the non-streamed ones carry usage


def test_serves_decision_log_replays_to_the_same_answers(serve_run: Run) -> None:
    assert serve_run.decision_log is not None
    spec, calls = serve_run.decision_log
    assert sum(c.method == "decide" for c in calls) == len(arrivals())
    assert not replay(calls, decode_spec(spec).build())
