"""predicted_ttft on hand-built views: the cache against the queue, TPOT feasibility with the
context decodes attend to, the busy-cluster work price, the eviction price, the share penalty,
KV events, ties."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.core.errors import ConfigError
from gateway.core.types import ClusterView, EngineView, RequestInfo
from gateway.perfmodel.presets import load_preset
from gateway.policies import Dispatcher, PolicyContext, create_policy
from gateway.policies.predicted_ttft import PredictedTtftPolicy
from gateway.policies.ttft_estimate import admission_wait_s, step_rate

BS = 16
PERF = load_preset("mistral-7b-a6000")


def ev(i: int, **kw: object) -> EngineView:
    return EngineView(id=f"e{i}", kv_capacity_blocks=PERF.kv_capacity_blocks, **kw)  # type: ignore[arg-type]


def view(*engines: EngineView) -> ClusterView:
    return ClusterView(tuple(engines))


def req(rid: str, hashes: tuple[int, ...], extra: int = 0, out: int = 64) -> RequestInfo:
    return RequestInfo(
        id=rid,
        block_hashes=hashes,
        prompt_tokens=BS * len(hashes) + extra,
        arrival=0.0,
        predicted_output_tokens=out,
    )


def make(**options: object) -> tuple[PredictedTtftPolicy, Dispatcher]:
    policy = create_policy("predicted_ttft", PolicyContext(seed=1, perf=PERF), options or None)
    assert isinstance(policy, PredictedTtftPolicy)
    return policy, Dispatcher(policy)


def warm(d: Dispatcher, r: RequestInfo, engine: str, n: int, now: float = 0.0) -> None:
    """Route ``r`` with only ``engine`` healthy, then finish it."""
    engines = [ev(i, healthy=f"e{i}" == engine) for i in range(n)]
    assert d.route(r, view(*engines), now).engine == engine
    d.finished(r, engine, now + 0.1, True)


DOC = tuple(range(1000, 1500))  # 500 blocks: 8,000 tokens, ~0.9 s to prefill cold


@pytest.mark.parametrize(("queued_tokens", "expected"), [(2_000, "e0"), (12_000, "e1")])
def test_a_hit_wins_until_its_queue_costs_more_than_the_prefill_elsewhere(
    queued_tokens: int, expected: str
) -> None:
    """e0 holds the document: 2,000 queued tokens (~0.3 s) cost less than prefilling 8,000
    tokens on idle e1 (~0.9 s); 12,000 queued tokens (~1.6 s) cost more."""
    _, d = make()
    warm(d, req("w", DOC), "e0", 2)
    v = view(ev(0, pending_prefill_tokens=queued_tokens), ev(1))
    decision = d.route(req("q", (*DOC, 7)), v, 60.0)  # the warm-up's prefill long done
    assert decision.engine == expected
    assert (decision.expected_hit_tokens > 0) == (expected == "e0")


def test_a_sequential_client_keeps_its_hit_right_after_a_prefill() -> None:
    """An idle engine's past prefill is over: it does not count as a duty cycle slowing the
    next request's decode there, so a client sending one request after another keeps its hit
    (with the 8,000-token prefill counted, its predicted TPOT sends it elsewhere)."""
    _, d = make()
    warm(d, req("w", DOC), "e0", 2)  # routed at 0.0, done by 0.1
    assert d.route(req("q", (*DOC, 7)), view(ev(0), ev(1)), 1.0).engine == "e0"


def test_an_idle_cluster_spreads_unique_prompts_evenly() -> None:
    """The turn rotation among near-equal engines, the share penalty and the routed prefill
    work (duty cycle) each spread them; any one of them suffices."""
    _, d = make()
    v = view(*(ev(i) for i in range(4)))
    counts = Counter(
        d.route(req(f"u{i}", (i * 10 + 1, i * 10 + 2)), v, i * 0.01).engine for i in range(40)
    )
    assert counts == {"e0": 10, "e1": 10, "e2": 10, "e3": 10}


def test_a_decode_batch_attending_to_a_shared_prefix_many_times_is_tpot_infeasible() -> None:
    """e0 holds the prefix and runs 60 sequences that each attend to its 8,000 tokens; its KV
    usage counts the prefix once (~4 %), so only the in-flight context shows the decode step
    at ~0.13 s, past the 0.1 s TPOT target: the request goes to idle e1. (share_weight 0:
    the router sent e0 all its recent requests, which alone would move this one; the decode
    term off, so that the TPOT target alone decides.)"""
    _, d = make(share_weight=0, decode_in_cost=False)
    warm(d, req("w", DOC), "e0", 2)
    for i in range(60):  # the router sent them: it knows their prompts
        d.route(req(f"r{i}", (*DOC, 10_000 + i)), view(ev(0), ev(1, healthy=False)), 0.1)
    busy = ev(0, num_running=60, kv_usage=0.04)
    decision = d.route(req("q", (*DOC, 7)), view(busy, ev(1)), 60.0)
    assert decision.engine == "e1"


def test_short_requests_in_flight_keep_the_same_engine_fast_enough() -> None:
    """The counterpart of the test above: the 60 sequences the router sent are 64-token
    prompts, so the batch attends to ~4,000 tokens and e0 keeps the hit. (With nothing in
    flight the policy assumes running sequences as long as this prompt.)"""
    _, d = make(share_weight=0, decode_in_cost=False)
    warm(d, req("w", DOC), "e0", 2)
    for i in range(60):
        d.route(
            req(f"r{i}", (20_000 + i, 30_000 + i, 40_000 + i, 50_000 + i)),
            view(ev(0), ev(1, healthy=False)),
            0.1,
        )
    busy = ev(0, num_running=60, kv_usage=0.04)
    assert d.route(req("q", (*DOC, 7)), view(busy, ev(1)), 60.0).engine == "e0"


@pytest.mark.parametrize(("work_weight", "expected"), [(2.0, "e0"), (0.0, "e1")])
def test_a_busy_cluster_prices_the_work_a_miss_adds(work_weight: float, expected: str) -> None:
    """Every engine has prefill queued (utilisation near its cap): e0's hit is predicted a
    little slower than a cold prefill on e1, but the 8,000 extra tokens e1 would prefill delay
    the requests behind it; with ``work_weight=0`` only the TTFT counts."""
    policy, d = make(work_weight=work_weight)
    warm(d, req("w", DOC), "e0", 2)
    cold = PERF.prefill_time(len(DOC) * BS, 0)
    queued_e1 = 6_000
    # e0's wait makes its TTFT ~0.05 s above e1's (both far below the 5 s SLO)
    rate = 2048 / PERF.step_time([(2048, 0)], 0, 0)
    queued_e0 = queued_e1 + int((cold + 0.05) * rate)
    v = view(ev(0, pending_prefill_tokens=queued_e0), ev(1, pending_prefill_tokens=queued_e1))
    for i in range(200):  # the share of engines with prefill queued, as routing sees it
        policy.predict(req(f"p{i}", (7,)), v)
        policy._busy += (policy._observed - policy._busy) / policy.config.busy_window
    rows = {p.engine.id: p for p in policy.predict(req("q", (*DOC, 7)), v)}
    assert rows["e0"].ttft_s > rows["e1"].ttft_s  # the premise: e1 is predicted faster
    assert d.route(req("q", (*DOC, 7)), v, 1.0).engine == expected


@pytest.mark.parametrize(("decode_weight", "expected"), [(1.0, "e1"), (0.0, "e0")])
def test_prefill_added_to_a_big_decode_batch_is_priced(decode_weight: float, expected: str) -> None:
    """Both engines have prefill queued; e0 runs 120 decodes, e1 20. A cold 8,000-token prompt
    is predicted 0.02 s faster on e0, but its prefill chunks would stretch e0's 120 decodes:
    ``decode_weight x u x prefill x running / mean running`` sends it to e1."""
    quiet = {"decode_aware": False, "work_weight": 0.0, "share_weight": 0.0, "evict_weight": 0.0,
             "harm_weight": 0.0}  # fmt: skip
    policy, d = make(decode_weight=decode_weight, **quiet)
    q = req("q", DOC)
    e0 = ev(0, num_running=120, pending_prefill_tokens=2_000)
    probe = ev(1, num_running=20, pending_prefill_tokens=0)
    rows = {p.engine.id: p for p in policy.predict(q, view(e0, probe))}
    rate = step_rate(PERF, probe, policy.flight.attended(PERF, probe, q.prompt_tokens))
    queued = int((rows["e0"].ttft_s - rows["e1"].ttft_s + 0.02) * rate.tokens_per_s)
    v = view(e0, ev(1, num_running=20, pending_prefill_tokens=queued))
    for i in range(200):  # every engine has prefill queued: u at its cap
        policy.predict(req(f"p{i}", (7,)), v)
        policy._busy += (policy._observed - policy._busy) / policy.config.busy_window
    rows = {p.engine.id: p for p in policy.predict(q, v)}
    assert rows["e1"].ttft_s > rows["e0"].ttft_s  # the premise: e0 is predicted faster
    assert d.route(q, v, 1.0).engine == expected


@pytest.mark.parametrize(("evict_weight", "expected"), [(3.0, "e1"), (0.0, "e0")])
def test_a_miss_on_a_full_engine_pays_for_what_it_evicts(
    evict_weight: float, expected: str
) -> None:
    """e0's cache (600 blocks as the index sees it) holds a document every request so far hit;
    a new 500-block document would evict most of it there. e1 has room but 500 tokens queued:
    without the eviction price e0 is a little faster; with it, e1 is cheaper."""
    _, d = make(evict_weight=evict_weight, index_blocks=600, share_weight=0.0, reuse_window=2)
    for i in range(4):  # the document, then questions that hit it: reuse near 1
        warm(d, req(f"w{i}", (*DOC, 90_000 + i)), "e0", 2, now=i * 0.2)
    other = tuple(range(5_000, 5_500))
    v = view(ev(0), ev(1, pending_prefill_tokens=500))
    assert d.route(req("new", other), v, 60.0).engine == expected


@pytest.mark.parametrize(("share_weight", "spread"), [(10.0, True), (0.0, False)])
def test_a_prefix_every_request_shares_does_not_pile_on_one_engine(
    share_weight: float, spread: bool
) -> None:
    """Views that never show the load (a replica blind to it, or a burst within one scrape):
    the share penalty keeps each engine's recent share of requests near 1/N."""
    # decode_in_cost off: the decode term alone also spreads them (the routed prefill work
    # raises the holder's predicted TPOT), which would hide the penalty
    _, d = make(share_weight=share_weight, decode_in_cost=False)
    system = tuple(range(1, 33))  # 512 shared tokens
    warm(d, req("w", system), "e0", 4)
    v = view(*(ev(i) for i in range(4)))
    routed = [
        d.route(req(f"s{i}", (*system, 50_000 + i), extra=8), v, 1.0 + i * 0.01).engine
        for i in range(400)
    ]
    counts = Counter(routed[200:])  # once the shares have settled (window 32 x 4 requests)
    busiest = max(counts.values()) / 200
    if spread:  # the cap is (1 + share_slack) / 4 = 0.3 of an EWMA that starts at 0
        assert len(counts) >= 3 and busiest <= 0.4, counts
    else:
        assert busiest > 0.9, counts


@pytest.mark.parametrize(("prefix_only", "expected"), [(True, "e0"), (False, "e1")])
def test_a_conversation_keeps_its_own_history_on_a_busy_engine(
    prefix_only: bool, expected: str
) -> None:
    """e0 took the last 40 requests (its share far above a fair quarter) and holds one
    conversation's 3,200-token history, which no other recent request began with. Its next
    turn stays there: the share penalty guards against a prefix most traffic shares, not a hit
    only one conversation wants. Charged on every hit, the penalty (10 cold prefills per excess
    share) sends it to prefill the history again on an idle engine."""
    _, d = make(share_prefix_only=prefix_only)
    for i in range(40):
        warm(d, req(f"o{i}", (7_000 + i,)), "e0", 4, now=i * 0.1)
    history = tuple(range(20_000, 20_200))
    warm(d, req("t1", history), "e0", 4, now=5.0)
    decision = d.route(req("t2", (*history, 30_000)), view(*(ev(i) for i in range(4))), 60.0)
    assert decision.engine == expected
    assert (decision.expected_hit_tokens > 0) == prefix_only


def test_kv_events_move_and_remove_what_the_index_believes() -> None:
    policy, d = make()
    assert policy.wants_cache_events is False
    v = view(ev(0), ev(1), ev(2))
    policy.on_cache_event("e2", DOC, ())  # e2 prefilled the document for another replica
    first = d.route(req("a", (*DOC, 1)), v, 60.0)  # its prefill long done
    assert (first.engine, first.expected_hit_tokens) == ("e2", len(DOC) * BS)
    d.finished(req("a", (*DOC, 1)), "e2", 1.5, True)
    policy.on_cache_event("e2", (), DOC)  # evicted
    policy.on_cache_reset("e2")
    again = d.route(req("b", (*DOC, 2)), v, 2.0)
    assert again.expected_hit_tokens == 0


def test_kv_events_are_requested_when_the_driver_has_them() -> None:
    policy = create_policy("predicted_ttft", PolicyContext(seed=1, perf=PERF, kv_events=True))
    assert policy.wants_cache_events is True


def test_an_engine_removed_is_forgotten() -> None:
    policy, d = make()
    warm(d, req("w", DOC), "e0", 2)
    d.route(req("r", (*DOC, 3)), view(ev(0), ev(1, healthy=False)), 1.0)
    policy.on_engine_removed("e0")
    assert policy.flight.requests("e0") == 0
    assert "e0" not in policy._share and "e0" not in policy.routed_work
    assert policy.index.match(DOC) == {}


@pytest.mark.parametrize(
    "bad", [{"work_weight": -1}, {"max_utilisation": 1.0}, {"share_window": 0}]
)
def test_bad_options_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="predicted_ttft"):
        create_policy("predicted_ttft", PolicyContext(seed=1, perf=PERF), bad)


def test_a_long_prompt_is_not_priced_behind_a_deep_queue_by_a_stream_of_short_ones() -> None:
    """Aging: a stream of short requests gave e0 most of the recent traffic, so the share
    penalty charged on every engine (``share_prefix_only=false``, a price that grows with the
    prompt; 10 cold prefills of it per excess share) prices it far above e1, which
    has 80,000 tokens queued (~8.7 s). A 60,000-token prompt (~6.5 s cold, no engine meets
    its 5 s target) still goes to e0: its wait may exceed the least-wait engine's by at most
    its own cold prefill (``wait_bound=1``). Without the bound it waits behind e1's queue."""
    long = req("long", tuple(range(5000, 5000 + 3750)))  # 60,000 tokens
    for bound, expected in ((1.0, "e0"), (0.0, "e1")):
        _, d = make(wait_bound=bound, share_prefix_only=False)
        for i in range(100):
            warm(d, req(f"s{i}", (9000 + i,)), "e0", 2, now=float(i))
        v = view(ev(0), ev(1, pending_prefill_tokens=80_000))
        assert d.route(long, v, 100.0).engine == expected, bound


@pytest.mark.parametrize(("cap", "expected"), [(0.3, "e0"), (0.0, "e1"), (None, "e0")])
def test_a_long_prompt_waits_beyond_the_least_wait_engine_at_most_a_share_of_its_target(
    cap: float | None, expected: str
) -> None:
    """The case above with ~3 s of queue on e1 (28,000 tokens): within the 60,000-token
    prompt's own cold prefill (~6.5 s) of the least wait, so the share penalty alone would send
    it there; the aging slack is also capped at ``wait_cap`` x the 5 s TTFT target (1.5 s), so
    it starts at once on e0. Such prompts miss their target anywhere: every second they are
    steered is tail (a Mooncake trace on 8 A6000 engines at its own rate: TTFT p99 8.9 s
    against least_loaded's 7.6, 7.3 with the cap). (None: the default.)"""
    long = req("long", tuple(range(5000, 5000 + 3750)))  # 60,000 tokens
    # the unscoped share penalty stands for any price that grows with the prompt
    _, d = make(share_prefix_only=False, **({} if cap is None else {"wait_cap": cap}))
    for i in range(100):
        warm(d, req(f"s{i}", (9000 + i,)), "e0", 2, now=float(i))
    v = view(ev(0), ev(1, pending_prefill_tokens=28_000))
    assert d.route(long, v, 100.0).engine == expected


def test_a_full_kv_cache_holds_a_new_prompt_until_running_sequences_finish() -> None:
    """e0 holds the document's 8,000 tokens and has no prefill queued, but its KV cache is
    99.9 % full: the 4,000 new tokens of a follow-up wait there for running sequences to
    finish (about half a predicted output of decode steps, ~2.2 s, ``kv_admission``), so it
    goes to e1, which has 15,000 tokens queued (~1.6 s) and room (80 % full). Without it the
    follow-up keeps its hit on e0, priced as if its prefill started at once."""
    follow_up = req("q", DOC, extra=4_000, out=64)
    for admission, expected in ((True, "e1"), (False, "e0")):
        _, d = make(kv_admission=admission, harm_weight=0.0)  # the admission wait alone
        warm(d, req("doc", DOC), "e0", 2)
        v = view(
            ev(0, num_running=10, kv_usage=0.999),
            ev(1, num_running=10, kv_usage=0.8, pending_prefill_tokens=15_000),
        )
        assert d.route(follow_up, v, 1.0).engine == expected, admission


def test_the_admission_wait_is_zero_while_the_request_fits() -> None:
    e = ev(0, num_running=10, kv_usage=0.5)
    assert admission_wait_s(PERF, e, 8_000, 256) == 0.0
    assert admission_wait_s(PERF, ev(0, kv_usage=0.999), 8_000, 256) == 0.0  # nothing runs
    full = ev(0, num_running=10, kv_usage=0.999)
    used = int(0.999 * PERF.kv_capacity_blocks) * PERF.block_size
    step = PERF.decode_step_time(10, used)
    assert admission_wait_s(PERF, full, 8_000, 256) == pytest.approx(128 * step)
    assert admission_wait_s(PERF, full, 8_000, 512) == pytest.approx(256 * step)


@pytest.mark.parametrize(("after_prefill", "expected"), [(True, "e0"), (False, "e1")])
def test_a_miss_is_not_tpot_feasible_where_its_prefill_would_slow_the_decodes_past_target(
    after_prefill: bool, expected: str
) -> None:
    """Both engines run 4 decodes and recently spent about a third of their steps on prefill.
    e0 holds the document, predicted at ~0.108 s per token (duty 0.35), just past the 0.1 s
    target; e1 at ~0.097 s (duty 0.30). A question on e1 re-prefills the 8,000-token document
    (~1 s more prefill than on e0), which raises e1's duty to ~0.4 and its decodes to ~0.12 s
    per token: judged with that prefill (``tpot_after_prefill``) neither engine is
    TPOT-feasible and the cheaper hit on e0 wins; judged without it, the filter sends the
    question to e1 and its re-prefill. (8 A6000 engines, ``gen:long_doc_qa?docs=100`` at
    22 req/s: hit 0.83 -> 0.92.) Judged on the steps' reading (``tpot_quantile=0``), where
    the re-prefill's seconds cross the target."""
    # a 10 s duty window: the ~1 s re-prefill moves e1's duty cycle by ~0.1
    policy, d = make(tpot_after_prefill=after_prefill, duty_window_s=10.0, tpot_quantile=0.0)
    warm(d, req("w", DOC), "e0", 2)
    policy.routed_work.add("e0", 3.5, 60.0)  # the prefill routed there over the last ~10 s
    policy.routed_work.add("e1", 3.0, 60.0)
    v = view(ev(0, num_running=4), ev(1, num_running=4))
    q = req("q", (*DOC, 7), out=40)
    rows = {p.engine.id: p for p in policy.predict(q, v, 60.0)}
    limit = q.slo.tpot_s
    assert rows["e0"].tpot_s > limit >= rows["e1"].tpot_s  # the premise
    assert (rows["e1"].tpot_after_s > limit) == after_prefill
    assert d.route(q, v, 60.0).engine == expected


def test_wait_cap_is_validated() -> None:
    with pytest.raises(ConfigError, match="wait_cap"):
        make(wait_cap=-0.1)
