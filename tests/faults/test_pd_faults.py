"""Faults of disaggregated serving behind the pd gateway: engine0 prefills, engine1 and
engine2 decode (round_robin; prefill timeout = the read timeout, 1.5 s). A breaker that
request failures opened closes after a successful trial request (traffic brings it back)."""

from __future__ import annotations

import time

import pytest
from faultkit import LONG, Fleet, Outcome, Watch, ask, record

pytestmark = pytest.mark.e2e


@pytest.fixture
def fl(fleet: Fleet) -> Fleet:
    fleet.reset(fleet.pd)
    return fleet


def pd_traffic(fl: Fleet, n: int, *, stream: bool = True) -> list[Outcome]:
    return [ask(fl.pd, stream=stream, prompt=f"{i} {time.monotonic_ns()} {LONG}") for i in range(n)]


def decoders(fl: Fleet) -> list:  # type: ignore[type-arg]
    return fl.engines[1:]


def bring_back(fl: Fleet, url: str) -> float:
    """Seconds of traffic until ``url``'s breaker closes (half-open: a trial request)."""
    t0 = time.monotonic()
    fl.pd.wait_all_closed(prompt=LONG)
    assert fl.pd.breaker(url) == "closed"
    return time.monotonic() - t0


def legs(fl: Fleet, outs: list[Outcome]) -> int:
    """Prefill legs engine0 received for ``outs``."""
    return fl.attempts([o.rid for o in outs], [fl.engines[0]])


def test_healthy_pd_runs_remote_prefills(fl: Fleet) -> None:
    before = fl.pd.metric("kvgate_pd_requests_total", {"mode": "remote"})
    outs = pd_traffic(fl, 4)
    assert all(o.ok for o in outs)
    assert fl.pd.metric("kvgate_pd_requests_total", {"mode": "remote"}) - before == 4
    fl.check_accounting({o.rid: o.ok for o in outs}, decoders(fl))


def test_a_slow_prefill_leg_only_delays_the_answer(fl: Fleet) -> None:
    fl.engines[0].fault("slow_prefill:0.4")
    outs = pd_traffic(fl, 3)
    assert all(o.ok and o.seconds >= 0.4 for o in outs), outs
    assert fl.pd.breaker(fl.engines[0].url) == "closed"
    fl.check_accounting({o.rid: o.ok for o in outs}, decoders(fl))
    record("slow_prefill:0.4", client_errors=0, min_latency_s=min(o.seconds for o in outs))


@pytest.mark.parametrize("fault", ["slow_prefill:2.5", "http500"])
def test_a_failing_prefill_leg_falls_back_to_a_local_prefill(fl: Fleet, fault: str) -> None:
    prefill = fl.engines[0]
    watch = Watch(fl.pd, prefill.url)
    before = fl.pd.metric("kvgate_pd_requests_total", {"mode": "fallback"})
    prefill.fault(fault)
    outs = pd_traffic(fl, 5)
    watch.stop()
    seen = [(round(o.seconds, 2), o.engine, o.error) for o in outs]
    assert all(o.ok for o in outs), seen
    fallbacks = fl.pd.metric("kvgate_pd_requests_total", {"mode": "fallback"}) - before
    # two failed legs take the prefill engine out (a half-open trial may add one): then
    # requests prefill on their decode engine without waiting for it
    assert 2 <= fallbacks <= 4, (fallbacks, seen)
    assert watch.out_s is not None
    assert min(o.seconds for o in outs[2:]) < 1.0, seen
    fl.check_accounting({o.rid: o.ok for o in outs}, decoders(fl))
    prefill.fault(None)
    back = bring_back(fl, prefill.url)
    assert fl.pd.metric("kvgate_pd_requests_total", {"mode": "remote"}) > 0
    record(
        f"prefill {fault}",
        client_errors=0,
        requests=len(outs),
        fallbacks=int(fallbacks),
        max_latency_s=max(o.seconds for o in outs),
        bring_back_s=back,
    )


def test_a_slow_kv_transfer_only_delays_the_answer(fl: Fleet) -> None:
    slow = fl.engines[1]
    slow.fault("slow_kv:0.4")
    outs = pd_traffic(fl, 4)
    assert all(o.ok for o in outs)
    on_slow = [o for o in outs if o.engine == slow.url]
    assert on_slow and all(o.seconds >= 0.4 for o in on_slow)
    assert fl.pd.breaker(slow.url) == "closed"
    fl.check_accounting({o.rid: o.ok for o in outs}, decoders(fl))
    record("slow_kv:0.4", client_errors=0, min_latency_s=min(o.seconds for o in on_slow))


def test_a_failed_kv_transfer_is_retried_on_another_decode_engine(fl: Fleet) -> None:
    bad = fl.engines[1]
    watch = Watch(fl.pd, bad.url)
    bad.fault("kv_fail")
    outs = pd_traffic(fl, 6)
    watch.stop()
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert all(o.engine == fl.engines[2].url for o in outs)
    failed = [x for x in bad.entries() if x["fault"] == "kv_fail"]
    assert 2 <= len(failed) <= 3 and watch.out_s is not None
    # each retry runs a new prefill leg (the first one's KV expires on the prefill engine)
    assert legs(fl, outs) == len(outs) + len(failed)
    fl.check_accounting({o.rid: o.ok for o in outs}, decoders(fl))
    bad.fault(None)
    back = bring_back(fl, bad.url)
    record("kv_fail", client_errors=0, engine_attempts=len(failed), bring_back_s=back)
