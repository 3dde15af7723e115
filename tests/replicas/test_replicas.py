"""Three kvgate replicas behind HAProxy route as well as one, and lose nothing they did not hold.

Workload: documents of about 1,000 tokens, each asked three questions in waves (every
document once per wave, its requests ``STAGGER_S`` apart), so that round robin puts a document's
questions on different replicas; the default policy, KV events and replica load sync on.
Hit rate is the engines' own (``vllm:prefix_cache_hits`` / ``queries``), each run on
fresh documents and emptied caches.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
from openai import APIConnectionError, APIError, AsyncOpenAI

from tests.replicas.conftest import MODEL, REPLICAS, Tier
from tests.replicas.services import haproxy_checks, haproxy_server_counters

pytestmark = pytest.mark.replicas

DOCS = 8
QUESTIONS = 3
STAGGER_S = 0.015
"""Requests of a wave start this far apart (~67 requests/s). A wave sent all at once makes
replicas decide within the same millisecond, blind to each other (docs/deployment.md)."""
SEQUENTIAL_S = 0.2
"""Requests of a wave this far apart: each is answered (tens of ms) before the next starts,
so no engine has a request in flight when a new document comes."""
WORDS = [
    "route",
    "cache",
    "prefix",
    "block",
    "engine",
    "replica",
    "token",
    "batch",
    "queue",
    "stream",
]


def document(tag: str, d: int) -> str:
    body = " ".join(WORDS[(d * 7 + i * 3) % len(WORDS)] + str(i % 97) for i in range(520))
    return f"[{tag}:{d}] {body}"  # ~4,000 characters: ~1,000 emulator tokens


@dataclass
class Answer:
    doc: int
    engine: str
    replica: str
    prompt: int
    cached: int


def client(url: str, timeout: float = 60) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=timeout)


async def ask(oa: AsyncOpenAI, tag: str, d: int, q: int, max_tokens: int = 4) -> Answer:
    raw = await oa.chat.completions.with_raw_response.create(
        model=MODEL,
        max_tokens=max_tokens,
        messages=[
            {"role": "system", "content": document(tag, d)},
            {"role": "user", "content": f"question {q} about document {d}?"},
        ],
    )
    r = raw.parse()
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return Answer(
        d,
        raw.headers["x-kvgate-engine"],
        raw.headers.get("x-kvgate-replica", "direct"),
        r.usage.prompt_tokens,
        r.usage.prompt_tokens_details.cached_tokens or 0,
    )


async def waves(url: str, tag: str, stagger_s: float) -> list[Answer]:
    oa = client(url)
    out: list[Answer] = []

    async def later(d: int, q: int) -> Answer:
        await asyncio.sleep(d * stagger_s)
        return await ask(oa, tag, d, q)

    for q in range(QUESTIONS):
        out += await asyncio.gather(*(later(d, q) for d in range(DOCS)))
        await asyncio.sleep(0.05)  # the engines' events of this wave reach every replica
    await oa.close()
    return out


@dataclass
class Run:
    hit_rate: float
    busiest_share: float
    answers: list[Answer]


def measure(tier: Tier, url: str, stagger_s: float = STAGGER_S) -> Run:
    tier.reset_caches()
    hits0 = tier.engine_counter("vllm:prefix_cache_hits_total")
    queries0 = tier.engine_counter("vllm:prefix_cache_queries_total")
    answers = asyncio.run(waves(url, uuid.uuid4().hex[:8], stagger_s))
    hits = sum(tier.engine_counter("vllm:prefix_cache_hits_total").values()) - sum(hits0.values())
    queries = sum(tier.engine_counter("vllm:prefix_cache_queries_total").values()) - sum(
        queries0.values()
    )
    per_engine = Counter(a.engine for a in answers)
    return Run(hits / queries, max(per_engine.values()) / len(answers), answers)


@dataclass
class Runs:
    one: Run
    """One replica alone (its peers idle)."""
    three: Run
    """Round robin over three replicas."""


@pytest.fixture(scope="module")
def runs(tier: Tier) -> Runs:
    """The same workload through one replica and through three, measured once per module
    for whichever test asks first (each test runs alone too)."""
    return Runs(measure(tier, tier.replicas[0].url), measure(tier, tier.url))


def test_three_replicas_reuse_the_cache_as_one_does(runs: Runs) -> None:
    one, three = runs.one, runs.three
    replicas = Counter(a.replica for a in three.answers)
    assert len(replicas) == REPLICAS, replicas  # HAProxy did spread them
    split = [
        len({a.replica for a in three.answers if a.doc == d}) for d in range(DOCS)
    ]  # how many replicas saw each document
    print(
        f"\nreplicas: hit rate one {one.hit_rate:.3f} three {three.hit_rate:.3f} "
        f"(ratio {three.hit_rate / one.hit_rate:.3f}); busiest engine share one "
        f"{one.busiest_share:.3f} three {three.busiest_share:.3f}; replicas per document {split}"
    )
    assert one.hit_rate > 0.5  # the workload does share prefixes
    assert sum(split) > DOCS  # and documents were asked through several replicas
    assert three.hit_rate >= 0.95 * one.hit_rate


def test_three_replicas_balance_as_one_does(tier: Tier, runs: Runs) -> None:
    """The replicas price engines alike with the default policy (predicted_ttft): prefix index
    and prefill duty cycle from the engines' KV events, load from the views and the NATS sync.

    Sequential new documents (``SEQUENTIAL_S`` apart: every engine idle when one comes) are
    spread by the prefill work each engine just did, through one replica and through three:
    measured busiest share 0.250 / 0.250 / 0.375 through one and 0.375 / 0.500 / 0.375
    through three (three runs, load average 30-35, code 73e6e69); ``cache_aware``, whose
    load is only the requests in flight (none here), puts them on its first engine: 0.750 /
    1.000 through one, 0.875 / 1.000 through three. Bounds: one document (``QUESTIONS``
    requests) above the worst measured.

    A strict expectation with its measured bound: the 8 first questions of a wave are routed
    within ~0.1 s, before a placement's KV events reach the other replicas, so one document
    more can land on one engine than through one replica (busiest share 0.375 against 0.250
    in every run at load average ~27, the 1.1x target met in 5 of 6 earlier runs at lower
    load; docs/deployment.md#what-a-second-replica-costs). More than that one document fails."""
    one, three = runs.one, runs.three
    assert len(one.answers) == len(three.answers) == DOCS * QUESTIONS
    one_document = QUESTIONS / len(three.answers)
    print(f"\nbalance: busiest share one {one.busiest_share:.3f}, three {three.busiest_share:.3f}")
    assert three.busiest_share <= one.busiest_share + one_document + 1e-9, (
        one.busiest_share,
        three.busiest_share,
    )
    alone = measure(tier, tier.replicas[0].url, SEQUENTIAL_S)
    spread = measure(tier, tier.url, SEQUENTIAL_S)
    print(f"sequential: busiest one {alone.busiest_share:.3f}, three {spread.busiest_share:.3f}")
    assert alone.busiest_share <= 0.375 + one_document + 1e-9, alone.busiest_share
    assert spread.busiest_share <= 0.5 + one_document + 1e-9, spread.busiest_share


async def stream(oa: AsyncOpenAI, n: int, tokens: int, started: asyncio.Event) -> tuple[str, str]:
    """(replica, outcome) of one long stream: ``ok`` with every token, or the error's type."""
    replica = "?"
    try:
        raw = await oa.completions.with_raw_response.create(
            model=MODEL,
            prompt=f"stream {n} {uuid.uuid4().hex}",
            max_tokens=tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        replica = raw.headers.get("x-kvgate-replica", "?")
        got = 0
        finish = None
        async for chunk in raw.parse():
            started.set()
            for choice in chunk.choices:
                got += 1 if choice.text else 0
                finish = choice.finish_reason or finish
        return replica, "ok" if finish == "length" and got >= tokens * 0.9 else f"short:{got}"
    except (APIError, APIConnectionError, httpx.HTTPError) as exc:
        return replica, type(exc).__name__


@dataclass
class Disruption:
    streams: list[tuple[str, str]]
    """(replica, outcome) of each long stream."""
    during: list[str]
    """Outcome of each new request sent after the signal (once the victim is gone, with
    ``until_dead``)."""
    dead_after_s: float | None = None
    """SIGKILL to the victim reaped (its sockets closed), with ``until_dead``."""
    ended_before: list[bool] = field(default_factory=list)
    """Per stream: it had ended before the signal was sent (the signal could not touch it)."""


async def streams_through(
    tier: Tier,
    victim: int,
    sig: int,
    *,
    until_dead: bool = False,
    count: int = 9,
    tokens: int = 600,
) -> Disruption:
    """``count`` streams through HAProxy; ``sig`` to replica ``victim`` once they flow, and
    short requests meanwhile (with ``until_dead``, once the victim has exited). Everything
    must end within 60 s (nothing hangs)."""
    oa = client(tier.url)
    started = [asyncio.Event() for _ in range(count)]
    tasks = [asyncio.create_task(stream(oa, n, tokens, started[n])) for n in range(count)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
    t0 = time.monotonic()
    tier.signal(victim, sig)
    ended_before = [t.done() for t in tasks]  # the loop ran none of them since the signal
    dead_after_s = None
    if until_dead:
        # Until the kernel has torn the process down (milliseconds), its listening socket
        # still completes handshakes: a request HAProxy sends then is reset unanswered, a read
        # error HAProxy 2.6 does not retry (docs/deployment.md#several-replicas). Such a
        # request was held by the victim; the requests below are sent once it is gone.
        await asyncio.to_thread(tier.replicas[victim].popen.wait, 10)
        dead_after_s = time.monotonic() - t0

    during: list[str] = []
    for d in range(6):  # new requests while the replica drains or is gone
        try:
            await ask(oa, "during", d, 0)
            during.append("ok")
        except (APIError, APIConnectionError) as exc:
            during.append(f"{type(exc).__name__}:{getattr(exc, 'status_code', '')}:{exc}")
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    await oa.close()
    return Disruption(results, during, dead_after_s, ended_before)


def test_a_sigtermed_replica_drains_its_streams(tier: Tier) -> None:
    victim = 1
    run = asyncio.run(streams_through(tier, victim, signal.SIGTERM))
    results, during = run.streams, run.during
    held = [o for r, o in results if r == f"r{victim}"]
    print(f"\nSIGTERM: {len(held)} of {len(results)} streams on the draining replica; {results}")
    assert held, "no stream went through the victim"
    assert all(o == "ok" for _, o in results), results
    assert all(o == "ok" for o in during), during  # HAProxy sent new requests elsewhere
    tier.replicas[victim].popen.wait(timeout=30)  # it exits once drained
    assert tier.replicas[victim].popen.returncode == 0
    tier.restart(victim)
    tier.wait_haproxy(REPLICAS)


def test_a_sigkilled_replica_loses_only_its_streams_and_a_restart_rebuilds_state(
    tier: Tier,
) -> None:
    victim = 2
    tag = uuid.uuid4().hex[:8]
    docs = range(4)

    async def place() -> list[Answer]:  # each document's first question, through HAProxy
        oa = client(tier.url)
        out = await asyncio.gather(*(ask(oa, tag, d, 0) for d in docs))
        await oa.close()
        return list(out)

    placed = {a.doc: a.engine for a in asyncio.run(place())}
    before = haproxy_server_counters(tier.haproxy, f"r{victim}")
    # HAProxy's checks of the victim are off until the new requests are answered: it stays UP
    # for them (its checks would find it DOWN within ~0.4 s, before or after the first of
    # them, depending on the machine's load), so round robin sends some to the dead replica
    haproxy_checks(tier.haproxy, f"r{victim}", enabled=False)
    try:
        run = asyncio.run(streams_through(tier, victim, signal.SIGKILL, until_dead=True))
    finally:
        haproxy_checks(tier.haproxy, f"r{victim}", enabled=True)
    after = haproxy_server_counters(tier.haproxy, f"r{victim}")
    results, during = run.streams, run.during
    # A stream the victim finished before the signal (all had started; on a loaded machine the
    # first can be done before the last starts) is not one it could lose.
    lost = [
        o for (r, o), ended in zip(results, run.ended_before, strict=True)
        if r == f"r{victim}" and not ended
    ]  # fmt: skip
    kept = [o for r, o in results if r != f"r{victim}"]
    moved = {k: after[k] - before[k] for k in ("econ", "wretr", "wredis")}
    print(
        f"\nSIGKILL: lost {len(lost)} (all on the killed replica), kept {len(kept)}: {results}; "
        f"dead after {run.dead_after_s * 1000:.1f} ms; new requests {during}, "
        f"HAProxy on the dead replica: {moved}"
    )
    assert lost and all(o != "ok" for o in lost), results  # clean client-side errors
    assert kept and all(o == "ok" for o in kept), results
    assert all(o == "ok" for o in during), during
    # ... and some of them were sent to the dead replica first (UP for HAProxy) and retried
    # on another one: the retry is what this checks
    assert moved["wredis"] >= 1, moved
    assert tier.replicas[victim].popen.wait(timeout=5) == -signal.SIGKILL

    t0 = time.monotonic()
    restarted = tier.restart(victim)  # returns when /ready: events replayed by then
    ready_s = time.monotonic() - t0

    async def probe() -> list[Answer]:  # second questions straight to the restarted replica
        oa = client(restarted.url)
        out = await asyncio.gather(*(ask(oa, tag, d, 1) for d in docs))
        await oa.close()
        return list(out)

    answers = asyncio.run(probe())
    print(f"restart: ready (state rebuilt from replayed events) in {ready_s:.2f} s")
    assert {a.doc: a.engine for a in answers} == placed  # routes like the replicas that placed
    assert all(a.cached >= 0.9 * (a.prompt - 32) for a in answers), answers
    assert ready_s < 20
    tier.wait_haproxy(REPLICAS)


def test_haproxy_checks_ready_and_routes_round_robin(tier: Tier) -> None:
    """The config under test is what docs/deployment.md shows (round robin, /ready checks)."""
    cfg = next(tier.logdir.glob("haproxy-*.cfg")).read_text()
    for line in ("balance roundrobin", "option httpchk GET /ready", "retry-on conn-failure"):
        assert line in cfg
    out = subprocess.run(["haproxy", "-v"], capture_output=True, text=True).stdout
    assert out.startswith("HAProxy version")
