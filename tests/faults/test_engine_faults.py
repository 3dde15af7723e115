"""One engine of three misbehaves behind the main gateway (round_robin, breakers with short
cooldowns): what clients see, that nothing hangs, that no request is lost or run twice, and
that the engine is taken out and brought back."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from faultkit import LONG, Engine, Fleet, Outcome, Watch, ask, record

pytestmark = pytest.mark.e2e


@pytest.fixture
def fl(fleet: Fleet) -> Fleet:
    fleet.reset(fleet.main)
    return fleet


def traffic(fl: Fleet, n: int, *, stream: bool = False) -> list[Outcome]:
    return [ask(fl.main, stream=stream) for _ in range(n)]


def bring_back(fl: Fleet, url: str, fault: str, **measured: float | int | str | None) -> float:
    """Clear the fault; seconds until the breaker is closed again (half-open in between)."""
    fl.engines[[e.url for e in fl.engines].index(url)].fault(None)
    t0 = time.monotonic()
    # the engine answers again: traffic finds it half-open, a trial (or probe) closes it
    deadline = t0 + 10
    while fl.main.breaker(url) != "closed" and time.monotonic() < deadline:
        ask(fl.main)
        time.sleep(0.02)
    back = time.monotonic() - t0
    assert fl.main.breaker(url) == "closed"
    served = [ask(fl.main).engine for _ in range(6)]
    assert url in served, served
    record(fault, bring_back_s=back, **measured)
    return back


@pytest.mark.parametrize("fault", ["http500", "http503", "queue_full", "reset"])
def test_failures_before_the_first_byte_are_retried_transparently(fl: Fleet, fault: str) -> None:
    bad = fl.engines[0]
    watch = Watch(fl.main, bad.url)
    bad.fault(fault)
    outs = traffic(fl, 6) + traffic(fl, 6, stream=True)
    out_s = watch.stop().out_s
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    assert all(o.engine != bad.url for o in outs)
    attempts = [x for x in bad.entries() if x["fault"] == fault]
    assert 2 <= len(attempts) <= 5, attempts  # two in a row trip the breaker; then trials only
    # taken out after two failures in a row; /health still answers, so after the cooldown a
    # probe closes the breaker and the next failures open it again, for twice as long
    assert out_s is not None and fl.main.engines()[bad.url]["breaker_trips"] >= 1
    assert fl.main.metric("kvgate_breaker_transitions_total", {"state": "open"}) >= 1
    fl.check_accounting({o.rid: o.ok for o in outs})
    back = bring_back(
        fl,
        bad.url,
        fault,
        client_errors=0,
        engine_attempts=len(attempts),
        taken_out_within_s=out_s,
    )
    assert back < 5


REFUSE_S = 3.0
"""Long enough for the 9 requests below on a loaded machine (with 1.5 s, one run at load
average 15-28 found the breaker closed again: docs/reliability.md)."""


def test_refused_connections_take_the_engine_out_at_once(fl: Fleet) -> None:
    bad = fl.engines[0]
    bad.fault(f"refuse:{REFUSE_S}")
    host, port = httpx.URL(bad.url).host, httpx.URL(bad.url).port
    deadline = time.monotonic() + 5  # the engine closes its listener on its loop: wait for it
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
        except ConnectionRefusedError:
            break
        assert time.monotonic() < deadline, "the engine still accepts connections"
        time.sleep(0.01)
    t0 = time.monotonic()
    outs = traffic(fl, 6) + traffic(fl, 3, stream=True)
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    assert time.monotonic() < t0 + REFUSE_S, "the traffic outlasted the refusal: nothing to see"
    assert fl.main.engines()[bad.url]["breaker"] in ("open", "half_open")
    assert "connect" in (fl.main.engines()[bad.url]["last_error"] or "")
    listening = t0 + REFUSE_S
    time.sleep(max(0.0, listening - time.monotonic()))
    deadline = time.monotonic() + 10
    while fl.main.breaker(bad.url) != "closed" and time.monotonic() < deadline:
        ask(fl.main)
    back = time.monotonic() - listening
    assert fl.main.breaker(bad.url) == "closed"
    fl.check_accounting({o.rid: o.ok for o in outs})
    record("refuse", client_errors=0, bring_back_s=back, max_latency_s=max(o.seconds for o in outs))


def stream_once(fl: Fleet, prompt: str, max_tokens: int) -> tuple[str, str]:
    """One streamed completion through the main gateway: (serving engine, raw SSE body)."""
    with httpx.stream(
        "POST",
        fl.main.url + "/v1/completions",
        json={"model": "fault-model", "prompt": prompt, "max_tokens": max_tokens, "stream": True},
        timeout=10,
    ) as r:
        return r.headers["x-kvgate-engine"], r.read().decode()


def test_an_engine_that_dies_mid_stream_ends_the_stream_cleanly(fl: Fleet) -> None:
    bad = fl.engines[0]
    bad.fault("midstream:2")
    outs = traffic(fl, 9, stream=True)
    failed = [o for o in outs if not o.ok]
    # committed streams are not retried: the client gets the engine's two events, then an
    # OpenAI error event and [DONE]; two such failures open the breaker (a third may be a
    # half-open trial once the cooldown is over)
    assert 2 <= len(failed) <= 3, [(o.engine, o.error) for o in outs]
    assert all(o.engine == bad.url and "mid-stream" in (o.error or "") for o in failed)
    assert all(o.chunks == 2 for o in failed)
    assert fl.main.breaker(bad.url) in ("open", "half_open")
    for attempt in range(2):
        engine, raw = stream_once(fl, "raw", 3)
        body = raw.encode()
        assert body.endswith(b"data: [DONE]\n\n")
        if engine != bad.url:  # out of routing now
            break
        # on a slow machine the 0.5 s cooldown may be over: one half-open trial, which
        # fails as well and reopens the breaker for twice as long; the next goes elsewhere
        assert attempt == 0, "the open breaker let a second request through"
        assert b'"error"' in body
    non_stream = traffic(fl, 3)
    assert all(o.ok for o in non_stream)
    fl.check_accounting({o.rid: o.ok for o in outs + non_stream})
    bring_back(fl, bad.url, "midstream", client_errors=len(failed), taken_out_after=2)


def test_raw_sse_of_a_mid_stream_failure_ends_with_done(fl: Fleet) -> None:
    bad = fl.engines[1]
    bad.fault("midstream:1", times=1)
    for _ in range(3):
        engine, body = stream_once(fl, "x", 5)
        if engine == bad.url:
            events = [e for e in body.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert '"error"' in events[-2] and "mid-stream" in events[-2]
            return
    pytest.fail("no stream reached the faulty engine")


def test_a_hung_engine_is_timed_out_retried_and_taken_out_by_probes(fl: Fleet) -> None:
    bad = fl.engines[0]
    watch = Watch(fl.main, bad.url)
    bad.fault("hang")
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda _: ask(fl.main, timeout=15), range(6)))
    fl.main.wait_breaker(bad.url, ["open", "half_open"], timeout=3)
    out_s = watch.stop().out_s
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    slowest = max(o.seconds for o in outs)
    assert slowest < 2.0 + 1.5  # the read timeout (2 s), then another engine
    later = traffic(fl, 3)
    assert all(o.ok and o.seconds < 1.0 for o in later)  # out of routing: no more waits
    fl.check_accounting({o.rid: o.ok for o in outs + later})
    bring_back(fl, bad.url, "hang", client_errors=0, max_latency_s=slowest, taken_out_s=out_s)


def broken_pages_served(engine: Engine) -> int:
    """How many times the engine's active fault was applied (``GET /_faults``)."""
    r = httpx.get(engine.url + "/_faults", timeout=5)
    r.raise_for_status()
    return int(r.json()["applied"])


@pytest.mark.parametrize("fault", ["metrics500", "metrics_garbage"])
def test_a_broken_metrics_page_leaves_the_engine_in_routing(fl: Fleet, fault: str) -> None:
    bad = fl.engines[2]
    bad.fault(fault)
    # the gateway's monitor really scraped the broken page (twice), whatever the machine's load
    deadline = time.monotonic() + 15
    while (applied := broken_pages_served(bad)) < 2:
        assert time.monotonic() < deadline, f"the broken /metrics was scraped {applied} times"
        time.sleep(0.02)
    outs = traffic(fl, 6)
    assert all(o.ok for o in outs)
    assert bad.url in {o.engine for o in outs}
    entry = fl.main.engines()[bad.url]
    assert entry["breaker"] == "closed" and entry["routable"]
    fl.check_accounting({o.rid: o.ok for o in outs})
    record(fault, client_errors=0, taken_out="no (metrics are advisory; last values kept)")


def test_a_flapping_engine_is_kept_out_longer_each_time(fl: Fleet) -> None:
    bad = fl.engines[0]
    bad.fault("flap:0.5")
    t0 = time.monotonic()
    outs: list[Outcome] = []
    served = 0
    while time.monotonic() - t0 < 4.0:
        o = ask(fl.main)
        outs.append(o)
        served += o.engine == bad.url
    entry = fl.main.engines()[bad.url]
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    assert entry["breaker_trips"] >= 2  # the cooldown doubled at least once
    fl.check_accounting({o.rid: o.ok for o in outs})
    bring_back(
        fl,
        bad.url,
        "flap",
        client_errors=0,
        trips=entry["breaker_trips"],
        share_served=round(served / len(outs), 2),
    )


def test_a_crashed_engine_is_taken_out_and_rejoins_after_a_restart(fl: Fleet) -> None:
    bad = fl.engines[2]
    bad.fault("crash")
    outs = traffic(fl, 6)
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    assert bad.popen is not None and bad.popen.wait(timeout=5) == 1
    assert fl.main.breaker(bad.url) in ("open", "half_open")
    survivors = [e for e in fl.engines if e is not bad]
    fl.check_accounting({o.rid: o.ok for o in outs}, survivors)
    bad.start().wait_ready("/health")
    t0 = time.monotonic()
    fl.main.wait_all_closed()
    back = time.monotonic() - t0
    fl.pd.wait_all_closed(prompt=LONG)
    fl.strict.wait_all_closed()
    record("crash", client_errors=0, bring_back_s=back)
