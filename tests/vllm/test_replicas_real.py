"""Three kvgate replicas behind HAProxy reuse the real vLLM engines' caches as one replica does.

The replica tier (``tests/replicas``) on the real-engine tier's engines: NATS, three
``kvgate serve`` replicas with the settings every replica shares (KV events, token keys,
replica load sync; the default policy) in front of the two unified vLLM CPU engines, HAProxy
(round robin, ``/ready`` checks) in front of them. Workload: ``DOCS`` documents of ~900
tokens, each asked ``QUESTIONS`` questions in sequential waves; with 4 documents and 3
replicas, round robin sends each document's questions to three different replicas, so a
follow-up reaches a replica that never routed its document and hits only if that replica
knows, from the engines' KV events, which engine holds it. Hit rate is the engines' own
(``vllm:prefix_cache_hits_total`` / ``queries_total``), compared with one replica alone on
the same workload (fresh documents).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from conftest import BLOCK, MODEL, Engine, Fleet, Gateway, start_gateway
from fidelity_lib import WORDS
from openai import OpenAI

from tests.promtext import sample_sum
from tests.replicas.services import (
    Service,
    binary,
    haproxy_up,
    replica_env,
    start_haproxy,
    start_nats,
)

pytestmark = pytest.mark.vllm

REPLICAS = 3
DOCS = 4  # not a multiple of REPLICAS: round robin moves each document to a new replica
QUESTIONS = 3
DOC_WORDS = 900  # ~1 token each with the tiny model's tokenizer


@dataclass
class Replicas:
    gateways: list[Gateway]
    haproxy: Service


@pytest.fixture(scope="module")
def replicas(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    if binary("haproxy") is None:
        pytest.fail("haproxy is missing: run scripts/setup_replicas.sh")
    logdir = tmp_path_factory.mktemp("replicas-real")
    nats = start_nats(logdir)
    args = [arg for e in fleet.unified for arg in ("--engine", e.url)]
    gateways: list[Gateway] = []
    haproxy = None
    try:
        for _ in range(REPLICAS):
            gateways.append(start_gateway(logdir, args, replica_env(nats.url), wait=False))
        for gw in gateways:
            gw.wait_ready()  # KV events replayed by then
        haproxy = start_haproxy(logdir, [gw.url for gw in gateways])
        deadline = time.monotonic() + 10
        while list(haproxy_up(haproxy).values()) != ["UP"] * REPLICAS:
            assert time.monotonic() < deadline, haproxy_up(haproxy)
            time.sleep(0.1)
        yield Replicas(gateways, haproxy)
    finally:
        for gw in gateways:
            gw.stop()
        for svc in (haproxy, nats):
            if svc is not None:
                svc.stop()


def question(tag: str, q: int, d: int) -> str:
    """A question of over two KV blocks: the request stores at least one new block, so the
    engine publishes KV events for every request (a shorter one may fit a partial block)."""
    rng = random.Random(f"{tag}:{d}:q{q}")
    words = " ".join(rng.choice(WORDS) for _ in range(2 * BLOCK + 8))
    return f"question {q} about document {d}: {words}?"


def document(tag: str, d: int) -> str:
    rng = random.Random(f"{tag}:{d}")
    return f"[{tag}:{d}] " + " ".join(rng.choice(WORDS) for _ in range(DOC_WORDS))


@dataclass
class Answer:
    doc: int
    engine: str
    replica: str
    cached: int


@dataclass
class Run:
    hit_rate: float
    answers: list[Answer]


def engine_counters(engines: list[Engine]) -> tuple[float, float]:
    return (
        sum(e.metric("vllm:prefix_cache_hits_total") for e in engines),
        sum(e.metric("vllm:prefix_cache_queries_total") for e in engines),
    )


def event_batches(gateways: list[Gateway]) -> list[float]:
    """KV event batches each replica has taken from the engines (each subscribes to all)."""
    return [
        sample_sum(httpx.get(gw.url + "/metrics", timeout=5).text, "kvgate_kv_event_batches_total")
        for gw in gateways
    ]


def events_delivered(gateways: list[Gateway], before: list[float]) -> None:
    """Wait until every replica has taken the same number of new event batches since
    ``before``, at least one per request of the wave: each request, sent alone, stores new
    blocks (its question is :func:`question`), and the engine publishes one batch per step."""
    deadline = time.monotonic() + 10
    while True:
        now = event_batches(gateways)
        new = {round(b - a) for a, b in zip(before, now, strict=True)}
        if len(new) == 1 and min(new) >= DOCS:
            return
        assert time.monotonic() < deadline, f"KV event batches before {before}, now {now}"
        time.sleep(0.02)


def measure(url: str, engines: list[Engine], gateways: list[Gateway]) -> Run:
    """Every document's question q, then every document's q+1, ... (one request at a time);
    a wave's KV events reach every replica before the next wave starts."""
    oa = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    tag = uuid.uuid4().hex[:8]  # fresh documents: nothing of them is cached yet
    hits0, queries0 = engine_counters(engines)
    answers = []
    for q in range(QUESTIONS):
        before = event_batches(gateways)
        for d in range(DOCS):
            raw = oa.chat.completions.with_raw_response.create(
                model=MODEL,
                max_tokens=2,
                messages=[
                    {"role": "system", "content": document(tag, d)},
                    {"role": "user", "content": question(tag, q, d)},
                ],
            )
            r = raw.parse()
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            answers.append(
                Answer(
                    d,
                    raw.headers["x-kvgate-engine"],
                    raw.headers.get("x-kvgate-replica", "direct"),
                    r.usage.prompt_tokens_details.cached_tokens or 0,
                )
            )
        events_delivered(gateways, before)
    hits, queries = engine_counters(engines)
    oa.close()
    return Run((hits - hits0) / (queries - queries0), answers)


def test_three_replicas_reuse_the_real_engines_cache_as_one_does(
    fleet: Fleet, replicas: Replicas
) -> None:
    gws = replicas.gateways
    one = measure(gws[0].url, fleet.unified, gws)  # one replica alone (peers idle)
    three = measure(replicas.haproxy.url, fleet.unified, gws)  # round robin over three
    seen_by = [len({a.replica for a in three.answers if a.doc == d}) for d in range(DOCS)]
    first = {a.doc: a.engine for a in three.answers[:DOCS]}
    print(
        f"\nreal replicas: hit rate one {one.hit_rate:.3f} three {three.hit_rate:.3f} "
        f"(ratio {three.hit_rate / one.hit_rate:.3f}); replicas per document {seen_by}; "
        f"documents per engine {sorted(list(first.values()).count(e.url) for e in fleet.unified)}"
    )
    assert one.hit_rate > 0.5  # the workload does share prefixes
    assert seen_by == [QUESTIONS] * DOCS  # every follow-up reached a new replica
    # Documents on both engines: a follow-up that ignored where its document is cached
    # would land on the other engine about half the time.
    assert len(set(first.values())) == len(fleet.unified), first
    assert three.hit_rate >= 0.95 * one.hit_rate, (one.hit_rate, three.hit_rate)
