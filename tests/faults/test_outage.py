"""Every engine fails at once: the breakers make the gateway fail fast, and the retry budget
keeps retries from multiplying the load when breakers do not trip (the strict gateway)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from faultkit import Fleet, ask, record

pytestmark = pytest.mark.e2e


def test_total_outage_fails_fast_with_retry_after_and_recovers(fleet: Fleet) -> None:
    fleet.reset(fleet.main)
    for e in fleet.engines:
        e.fault("http500")
    outs = [ask(fleet.main) for _ in range(12)]
    assert not any(o.ok for o in outs)
    assert all(o.status == 503 and o.retry_after for o in outs), [(o.status, o.error) for o in outs]
    attempts = fleet.attempts([o.rid for o in outs])
    # two failures per engine open the three breakers; then only half-open trials
    assert attempts <= 3 * 2 + 4, attempts
    fast = [o.seconds for o in outs[-4:]]
    assert max(fast) < 0.5
    fleet.check_accounting({o.rid: o.ok for o in outs})
    for e in fleet.engines:
        e.fault(None)
    t0 = time.monotonic()
    fleet.main.wait_all_closed()
    back = time.monotonic() - t0
    assert ask(fleet.main).ok
    record(
        "total outage (breakers)",
        requests=len(outs),
        engine_attempts=attempts,
        client_errors=f"{len(outs)} x 503 + Retry-After",
        fail_fast_s=max(fast),
        bring_back_s=back,
    )


def test_retry_budget_caps_upstream_attempts_in_a_total_outage(fleet: Fleet) -> None:
    fleet.reset(fleet.strict)
    g = fleet.strict  # breakers never trip on 5xx here: only the budget limits retries
    for e in fleet.engines:
        e.fault("http500")
    n = 60
    before = g.metric("kvgate_retry_budget_exhausted_total")
    with ThreadPoolExecutor(3) as pool:  # max_in_flight is 3
        outs = list(pool.map(lambda _: ask(g), range(n)))
    assert not any(o.ok for o in outs)
    assert all(o.status == 503 and o.retry_after == "1" for o in outs)
    attempts = fleet.attempts([o.rid for o in outs])
    budget = 0.2 * n + 1.0 * 10  # ratio x requests + min_per_s x window
    assert n <= attempts <= n + budget + 1, attempts  # without a budget: 3 x 60 = 180
    exhausted = g.metric("kvgate_retry_budget_exhausted_total") - before
    assert exhausted >= n - budget - 1
    assert sum("retry budget" in (o.error or "") for o in outs) == exhausted
    fleet.check_accounting({o.rid: o.ok for o in outs})
    record(
        "total outage (retry budget, no breaker)",
        requests=n,
        engine_attempts=attempts,
        without_budget=3 * n,
        budget_exhausted=int(exhausted),
    )
    for e in fleet.engines:
        e.fault(None)
    assert ask(g).ok
