"""predicted_ttft's decode-harm price: the decodes running on an engine wait out the prefill a
choice adds there, counted in proportion to the TPOT headroom it uses."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.core.errors import ConfigError
from gateway.core.types import EngineView, RequestInfo
from gateway.policies.predicted_ttft import PredictedTtftPolicy
from gateway.policies.ttft_estimate import step_rate
from tests.policies.test_predicted_ttft import DOC, PERF, ev, make, req, view

# every other price off, so the request's TTFT and the harm price decide
QUIET = {
    "work_weight": 0.0,
    "share_weight": 0.0,
    "evict_weight": 0.0,
    "decode_weight": 0.0,
    "decode_in_cost": False,
}


def slower_by(
    policy: PredictedTtftPolicy, q: RequestInfo, fast: EngineView, slow: EngineView, by: float
) -> EngineView:
    """``slow`` with enough prefill queued that ``q``'s predicted TTFT there is ``by`` seconds
    above its TTFT on ``fast``."""
    rows = {p.engine.id: p for p in policy.predict(q, view(fast, slow))}
    rate = step_rate(PERF, slow, policy.flight.attended(PERF, slow, q.prompt_tokens))
    gap = rows[fast.id].ttft_s - rows[slow.id].ttft_s + by
    return EngineView(
        id=slow.id,
        kv_capacity_blocks=slow.kv_capacity_blocks,
        num_running=slow.num_running,
        pending_prefill_tokens=int(gap * rate.tokens_per_s),
    )


@pytest.mark.parametrize(("harm_weight", "expected"), [(1.0, "e1"), (0.0, "e0")])
def test_a_cold_document_goes_where_fewer_decodes_wait_it_out(
    harm_weight: float, expected: str
) -> None:
    """A cold 8,000-token document (~0.9 s of prefill) is predicted 0.1 s faster on e0, which
    runs 12 decodes, than on e1, which runs 2: its chunks would stretch twelve decodes' steps
    by ~0.9 s each, a fifth of their TPOT headroom over 64 tokens, so e1 costs less."""
    policy, d = make(harm_weight=harm_weight, **QUIET)
    q = req("q", DOC)
    e0 = ev(0, num_running=12)
    e1 = slower_by(policy, q, e0, ev(1, num_running=2), 0.1)
    rows = {p.engine.id: p for p in policy.predict(q, view(e0, e1))}
    assert rows["e1"].ttft_s > rows["e0"].ttft_s  # the premise: e0 starts it sooner
    assert d.route(q, view(e0, e1), 0.0).engine == expected


def test_a_short_prompt_beside_a_big_batch_costs_almost_nothing() -> None:
    """A 160-token prompt adds ~0.02 s to each of 120 decodes on e0: spread over 64 tokens, a
    sliver of their TPOT headroom, so e0, 0.05 s sooner, still wins over e1 with 10 decodes
    (counted in full, the 120 decodes' 2.4 s would send it to e1)."""
    policy, d = make(**QUIET)
    q = req("q", tuple(range(10)))
    e0 = ev(0, num_running=120)
    e1 = slower_by(policy, q, e0, ev(1, num_running=10), 0.05)
    rows = {p.engine.id: p for p in policy.predict(q, view(e0, e1))}
    full = rows["e0"].work_s * rows["e0"].slowdown * 120
    assert full - rows["e1"].work_s * rows["e1"].slowdown * 10 > 0.05  # counted in full: e1
    assert d.route(q, view(e0, e1), 0.0).engine == "e0"


def test_past_the_target_the_harm_counts_harm_past_target_of_it() -> None:
    """Where the engine's predicted TPOT is already at the target, every decode there pays
    ``harm_past_target`` (one half) of the prefill; with headroom, the share the prefill's
    rise uses."""
    policy, _ = make(**QUIET)
    q = req("q", DOC, out=64)
    rows = policy.predict(q, view(ev(0, num_running=4)))
    prices = policy.prices(q, rows, 64.0)
    (p,) = rows
    delay = p.work_s * p.slowdown
    harm = policy.cost_terms(p, q, prices)["decode harm"]
    headroom = q.slo.tpot_s - p.tpot_s
    assert harm == pytest.approx(4 * delay * min(1.0, delay / 64 / headroom))
    assert harm < 4 * delay
    spent = replace(prices, tpot_limit=p.tpot_s)
    assert policy.cost_terms(p, q, spent)["decode harm"] == pytest.approx(0.5 * 4 * delay)
    full, _ = make(harm_past_target=1.0, **QUIET)
    assert full.cost_terms(p, q, spent)["decode harm"] == pytest.approx(4 * delay)
    idle = policy.predict(q, view(ev(0)))[0]  # nothing running: no one waits
    assert policy.cost_terms(idle, q, prices)["decode harm"] == 0.0


@pytest.mark.parametrize(("harm_past_target", "expected"), [(0.5, "e0"), (1.0, "e1")])
def test_an_engine_past_its_tpot_target_is_not_shunned(
    harm_past_target: float, expected: str
) -> None:
    """Both engines are past their TPOT limit (0.3 x the 0.1 s target): e0 runs 200 decodes,
    e1 80 but would start the prompt later by three quarters of the difference in what their
    decodes wait out. Those decodes miss their target either way: at one half the prompt
    starts on e0 rather than queueing on e1 (counted in full, prompts left every engine past
    target for the others' queues: an 8 x A6000 chat_burst's TTFT p99 12.0 s against
    least_loaded's 10.8 s)."""
    policy, d = make(harm_past_target=harm_past_target, tpot_headroom=0.3, **QUIET)
    q = req("q", tuple(range(10)))
    e0 = ev(0, num_running=200)
    (p0,) = policy.predict(q, view(e0))
    (p1,) = policy.predict(q, view(ev(1, num_running=80)))
    gap = p0.work_s * p0.slowdown * 200 - p1.work_s * p1.slowdown * 80
    e1 = slower_by(policy, q, e0, ev(1, num_running=80), 0.75 * gap)
    rows = policy.predict(q, view(e0, e1))
    prices = policy.prices(q, rows, 64.0)
    assert all(p.tpot_s > prices.tpot_limit for p in rows)  # the premise: no headroom left
    assert max(p.ttft_s for p in rows) < q.slo.ttft_s  # the aging bound allows either
    assert d.route(q, view(e0, e1), 0.0).engine == expected


def test_harm_weight_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match="harm_weight"):
        make(harm_weight=-1.0)


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_harm_past_target_must_be_a_share(share: float) -> None:
    with pytest.raises(ConfigError, match="harm_past_target"):
        make(harm_past_target=share)
