"""Behaviour of the Preble policy through the Dispatcher, on hand-built cluster views.

Times come from a perf model with explicit coefficients: prefill costs exactly 1 ms per new
token (no fixed part, no context term), so every expected load and cost below is exact.
"Forcing" a request onto an engine means routing it with a view in which only that engine is
healthy: the policy still decides and learns through its ordinary hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.blocks import hashes_from_segments
from gateway.core.errors import ConfigError
from gateway.core.types import ClusterView, Decision, EngineView, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.perfmodel.presets import DEFAULT_PRESET, load_preset
from gateway.policies import Dispatcher, PolicyContext, create_policy, policy_names
from gateway.policies.preble import PreblePolicy
from gateway.sim.loop import ClusterSpec
from gateway.sim.metrics import cache_hit_upper_bound, summarize
from gateway.sim.runner import run_policy
from gateway.sim.workloads import load_workload

BS = 16
PERF = PerfModel(name="test", prefill_a=0.0, prefill_b=1.0, decode_e0=1.0, block_size=BS)


PAPER = {"queue_aware": False, "pd_balance": True, "tpot_aware": False}
"""The paper's window load (no queue term), P/D balancing on and no TPOT filter: what the tests
below pin down. kvgate's defaults (queue-aware load, P/D balancing off, TPOT-aware explore) are
tested in tests/policies/test_preble_defaults.py."""


def make(**options: object) -> tuple[PreblePolicy, Dispatcher]:
    ctx = PolicyContext(block_size=BS, perf=PERF)
    policy = create_policy("preble", ctx, {**PAPER, **options})
    assert isinstance(policy, PreblePolicy)
    return policy, Dispatcher(policy)


def blocks(*segments: tuple[int, int]) -> tuple[int, ...]:
    """Chained hashes of a prompt made of ``(segment id, blocks)`` pieces."""
    return hashes_from_segments([(seg, n * BS) for seg, n in segments], BS)


_ids = iter(range(1_000_000))


def req(
    hashes: Sequence[int], extra: int = 1, at: float = 0.0, tokens: int | None = None
) -> RequestInfo:
    prompt = tokens if tokens is not None else BS * len(hashes) + extra
    return RequestInfo(
        id=f"r{next(_ids)}", block_hashes=tuple(hashes), prompt_tokens=prompt, arrival=at
    )


def view(ids: Sequence[str], *, only: str | None = None, cap: dict[str, int] | None = None):
    cap = cap or {}
    return ClusterView(
        tuple(
            EngineView(id=e, healthy=only in (None, e), kv_capacity_blocks=cap.get(e, 0))
            for e in ids
        )
    )


def force(
    d: Dispatcher, r: RequestInfo, engine: str, ids: Sequence[str], now: float = 0.0, **kw
) -> Decision:
    decision = d.route(r, view(ids, only=engine, **kw), now)
    assert decision.engine == engine
    return decision


E2 = ("e0", "e1")
E3 = ("e0", "e1", "e2")
QUIET = {"initial_tpot_s": 0.0, "rebalance": False, "pd_balance": False}  # load = prefill only


# -- registry and config ------------------------------------------------------------------
def test_registered_and_wants_cache_events() -> None:
    assert "preble" in policy_names()
    policy, _ = make()
    assert policy.wants_cache_events


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"windw_s": 10}, "unknown option"),
        ({"replicate": "maybe"}, "not a valid bool"),
        ({"window_s": "soon"}, "not a valid float"),
        ({"th_bal": "0.5"}, "th_bal"),
        ({"window_s": "0"}, "window_s"),
        ({"max_tree_blocks": "0"}, "max_tree_blocks"),
        ({"pd_margin": "-0.1"}, "pd_margin"),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_policy("preble", options=options)


def test_options_are_coerced_from_strings() -> None:
    policy = create_policy(
        "preble", options={"window_s": "30", "explore": "off", "max_tree_blocks": "64"}
    )
    assert isinstance(policy, PreblePolicy)
    assert policy.config.window_s == 30.0
    assert policy.config.explore is False
    assert policy.tree.max_blocks == 64
    assert policy.tree.window_s == 30.0


# -- exploit ----------------------------------------------------------------------------------
P = blocks((1, 4))  # a 4-block prompt


@pytest.mark.parametrize(
    ("longer_on_e0", "expected", "hit"),
    [
        (False, "e1", 4 * BS),  # e0 and e1 hold the match: the lighter holder e1
        (True, "e0", 5 * BS),  # e0 holds a longer match: it alone is the holder
    ],
)
def test_exploit_goes_to_the_least_loaded_holder(
    longer_on_e0: bool, expected: str, hit: int
) -> None:
    _, d = make(**QUIET)
    q = blocks((1, 4), (2, 1))
    force(d, req(q if longer_on_e0 else P), "e0", E3)  # e0 load 0.065 or 0.081
    force(d, req(P), "e1", E3)  # e1 load 0.065
    force(d, req(blocks((3, 2))), "e0", E3)  # e0 load + 0.033: e0 is heavier than e1
    # e2 holds nothing and is the lightest: exploit ignores it
    decision = d.route(req(q, extra=1), view(E3), 1.0)
    assert (decision.engine, decision.reason) == (expected, "preble:exploit")
    assert decision.expected_hit_tokens == hit


def test_exploit_needs_more_matched_than_unmatched_tokens() -> None:
    _, d = make(**QUIET)
    force(d, req(blocks((1, 2))), "e0", E2)  # e0 holds 2 blocks: load 0.033
    half = req(blocks((1, 2), (5, 2)), extra=0)  # 32 matched, 32 not: explore
    decision = d.route(half, view(E2), 1.0)
    # explore: e0 0.033 + 0.032 = 0.065 vs e1 0 + 0.064
    assert (decision.engine, decision.reason) == ("e1", "preble:explore")
    more = req(blocks((1, 2), (6, 1)), extra=15)  # 32 matched, 31 not: exploit
    decision = d.route(more, view(E2), 2.0)
    assert (decision.engine, decision.reason) == ("e0", "preble:exploit")


@pytest.mark.parametrize(
    ("prompt", "expected", "reason"),
    [
        (blocks((7, 3)), "e1", "preble:cold"),  # nothing cached: the least loaded
        (blocks((1, 1), (8, 3)), "e0", "preble:exploit"),  # 1 of 4 blocks: still the holder
    ],
)
def test_explore_off_always_follows_the_longest_match(
    prompt: tuple[int, ...], expected: str, reason: str
) -> None:
    _, d = make(explore=False, **QUIET)
    force(d, req(P), "e0", E2)
    decision = d.route(req(prompt), view(E2), 1.0)
    assert (decision.engine, decision.reason) == (expected, reason)


# -- explore: L + M + P -----------------------------------------------------------------------
@pytest.mark.parametrize(("with_capacity", "expected"), [(True, "e1"), (False, "e0")])
def test_eviction_cost_changes_the_explore_choice(with_capacity: bool, expected: str) -> None:
    """e0 is full of a hot prefix: placing a new prompt there would evict it (M > 0)."""
    _, d = make(**QUIET)
    cap = {"e0": 8, "e1": 1000} if with_capacity else {}
    hot = blocks((1, 8))
    for t in range(4):  # load 0.129 + 3 x 0.001 (hits) = 0.132
        force(d, req(hot, at=t), "e0", E2, float(t), cap=cap)
    force(d, req(blocks((2, 12)), extra=8), "e1", E2, 4.0, cap=cap)  # load 0.200
    decision = d.route(req(blocks((3, 4))), view(E2, cap=cap), 5.0)
    # e0: L 0.132 + P 0.065 + M (0.128 x 4/5 of the window's requests) = 0.299
    # e1: L 0.200 + P 0.065 + M 0 = 0.265
    assert (decision.engine, decision.reason) == (expected, "preble:explore")


@pytest.mark.parametrize(("shares_prefix", "expected"), [(True, "e1"), (False, "e0")])
def test_partial_match_lowers_the_prefill_cost(shares_prefix: bool, expected: str) -> None:
    _, d = make(**QUIET)
    force(d, req(blocks((1, 4), (2, 1))), "e1", E2)  # e1 holds (1, 4): load 0.081
    force(d, req(blocks((3, 3)), extra=2), "e0", E2)  # load 0.050
    prompt = blocks((1, 4), (4, 6)) if shares_prefix else blocks((5, 10))
    decision = d.route(req(prompt), view(E2), 1.0)
    # 161 tokens, 64 of them cached on e1 when shared (64 < 97: explore, not exploit):
    # e1 0.081 + 0.097 = 0.178 < e0 0.050 + 0.161 = 0.211; unshared e1 costs 0.242
    assert (decision.engine, decision.reason) == (expected, "preble:explore")
    assert decision.expected_hit_tokens == (64 if expected == "e1" else 0)


# -- P/D balancing ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "expected", "reason"),
    [
        ({}, "e1", "preble:pd_balance"),
        ({"pd_balance": False}, "e0", "preble:explore"),
        ({"pd_margin": 0.01}, "e0", "preble:explore"),  # e1 not within 1 % of the best
    ],
)
def test_pd_balance_picks_the_most_decode_heavy_near_best(
    options: dict[str, object], expected: str, reason: str
) -> None:
    _, d = make(initial_tpot_s=0.001, rebalance=False, **options)  # decode 128 x 1 ms
    force(d, req(blocks((1, 62)), extra=8), "e0", E2)  # 1.000 + 0.128: prefill-heavy
    for _ in range(9):  # 9 x (0.001 + 0.128) = 1.161: decode-heavy
        force(d, req((), tokens=1), "e1", E2)
    decision = d.route(req(blocks((2, 6)), extra=4), view(E2), 1.0)
    # explore costs: e0 1.128 + 0.100 = 1.228 (best), e1 1.161 + 0.100 = 1.261 (within 10 %)
    assert (decision.engine, decision.reason) == (expected, reason)


# -- post-assignment rebalancing ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "expected", "reason"),
    [
        ({}, "e2", "preble:rebalance"),  # to the lightest engine, not merely a lighter one
        ({"rebalance": False}, "e0", "preble:exploit"),
        ({"rebalance_warmup": 2}, "e0", "preble:exploit"),  # 4 routed < 2 x 3 engines
        ({"rebalance_min_gap_s": 5.0}, "e0", "preble:exploit"),  # gap 1.95 s < 5 s
        ({"th_bal": 50.0}, "e0", "preble:exploit"),  # 2.0 < 50 x 0.05
    ],
)
def test_rebalance_redirects_to_the_lightest_after_warmup(
    options: dict[str, object], expected: str, reason: str
) -> None:
    opts = {"initial_tpot_s": 0.0, "pd_balance": False, "rebalance_warmup": 1, **options}
    _, d = make(**opts)
    big = blocks((1, 62))
    force(d, req(big, extra=8), "e0", E3)  # 1.000
    force(d, req(blocks((2, 62)), extra=8), "e0", E3)  # 2.000 in all
    force(d, req(blocks((3, 6)), extra=4), "e1", E3)  # 0.100
    force(d, req(blocks((4, 3)), extra=2), "e2", E3)  # 0.050
    decision = d.route(req(big, extra=8), view(E3), 1.0)  # a full hit on e0
    assert (decision.engine, decision.reason) == (expected, reason)
    assert decision.expected_hit_tokens == (0 if expected == "e2" else 62 * BS)


# -- hot-prefix replication ---------------------------------------------------------------------
def run_replication(
    late_ttft: float, **options: object
) -> tuple[PreblePolicy, Dispatcher, list[str]]:
    """4 requests with TTFT 0.1 s early in a 100 s window, 4 with ``late_ttft`` late in it,
    then 12 more for the same prompt; returns where the 12 went."""
    policy, d = make(window_s=100.0, rebalance=False, **options)
    for t, ttft in [(0, 0.1), (1, 0.1), (2, 0.1), (3, 0.1)] + [
        (60 + i, late_ttft) for i in range(4)
    ]:
        r = req(P, at=float(t))
        decision = d.route(r, view(E2), float(t))
        assert decision.engine == "e0"
        d.first_token(r, decision.engine, t + ttft)
    after = [d.route(req(P, at=70.0 + i), view(E2), 70.0 + i).engine for i in range(12)]
    return policy, d, after


def test_replication_adds_a_second_holder_and_exploit_spreads() -> None:
    policy, _, after = run_replication(late_ttft=1.0)
    assert policy.replications == 1
    assert set(after) == {"e0", "e1"}
    assert after[0] == "e1"  # the new replica has no load yet


@pytest.mark.parametrize(
    ("late_ttft", "options"),
    [
        (1.0, {"replicate": False}),
        (0.19, {}),  # late TTFT < 2 x early
        (1.0, {"replicate_min_samples": 5}),  # only 4 samples in each half
        (1.0, {"replicate_ratio": 20.0}),
    ],
)
def test_no_replication_without_its_trigger(late_ttft: float, options: dict[str, object]) -> None:
    policy, _, after = run_replication(late_ttft, **options)
    assert policy.replications == 0
    assert set(after) == {"e0"}
    assert policy.tree.match(P).per_engine == {"e0": 4}


def test_replication_marks_the_prefix_on_the_target() -> None:
    policy, _, _ = run_replication(late_ttft=1.0)
    assert policy.tree.match(P).per_engine == {"e0": 4, "e1": 4}


def test_replication_after_a_split_keeps_the_tree_consistent() -> None:
    policy, d = make(window_s=100.0, rebalance=False)
    pending = []
    for t, ttft in [(0, 0.1), (1, 0.1), (2, 0.1), (3, 0.1)] + [(60 + i, 1.0) for i in range(4)]:
        r = req(P, at=float(t))
        assert d.route(r, view(E2), float(t)).engine == "e0"
        pending.append((r, t + ttft))
    for r, when in pending[:4]:
        d.first_token(r, "e0", when)
    # before the late requests' first tokens, a prompt sharing 3 of P's 4 blocks splits the
    # node; it goes to e0 (exploit), which then holds the head [P0, P1, P2] and the tail [P3]
    assert d.route(req(blocks((1, 3), (9, 1))), view(E2), 63.5).engine == "e0"
    for r, when in pending[4:]:
        d.first_token(r, "e0", when)
    assert policy.replications == 1
    tree = policy.tree
    for node in tree.nodes():
        if "e1" in node.engines and node.parent is not tree.root:
            assert "e1" in node.parent.engines
    d.cache_event("e1", [], [P[0]])  # e1 evicted the first block of P: it holds nothing of P
    assert "e1" not in tree.match(P).per_engine


# -- eviction events and modelled evictions -----------------------------------------------------
@pytest.mark.parametrize(
    ("removed", "e0_blocks", "expected"),
    [
        ([], 4, "e0"),  # no event: the lighter holder
        ([P[0]], 0, "e1"),
        ([P[2]], 2, "e1"),  # e0 now holds 2 blocks, e1 all 4
        ([P[3]], 3, "e1"),
        ([12345], 4, "e0"),  # a block the tree does not know
    ],
)
def test_eviction_events_stop_preferring_the_evicting_holder(
    removed: list[int], e0_blocks: int, expected: str
) -> None:
    policy, d = make(**QUIET)
    force(d, req(P), "e0", E2)
    force(d, req(P), "e1", E2)
    force(d, req(blocks((2, 2))), "e1", E2)  # e1 is the heavier holder
    d.cache_event("e0", [111], removed)
    assert policy.tree.match(P).per_engine.get("e0", 0) == e0_blocks
    assert policy.tree.cached_blocks("e0") == e0_blocks
    decision = d.route(req(blocks((1, 4), (3, 1))), view(E2), 1.0)
    assert decision.engine == expected


def test_modelled_evictions_keep_engines_within_capacity() -> None:
    policy, d = make(**QUIET)
    cap = {"e0": 10, "e1": 10}
    d.cache_event("e1", [1], [])  # e1 reports its own evictions: nothing is modelled for it
    prompts = [blocks((100 + i, 4)) for i in range(8)] + [blocks((1, 12))]  # the last > capacity
    for i, prompt in enumerate(prompts):
        force(d, req(prompt), "e0", E2, float(i), cap=cap)
        force(d, req(prompt), "e1", E2, float(i), cap=cap)
        assert policy.tree.cached_blocks("e0") <= 10
        if i < 8:
            assert policy.tree.match(prompt).per_engine["e0"] == 4  # the newest stays
    assert policy.tree.cached_blocks("e1") == 8 * 4 + 12


def test_shared_prefix_outlives_its_tails_under_modelled_eviction() -> None:
    policy, d = make(**QUIET)
    cap = {"e0": 8}
    shared = (1, 4)
    for i in range(6):
        force(d, req(blocks(shared, (10 + i, 2))), "e0", ("e0",), float(i), cap=cap)
        assert policy.tree.cached_blocks("e0") <= 8
    # LRU drops the old tails, never the shared root before them
    assert policy.tree.match(blocks(shared, (15, 2))).per_engine == {"e0": 6}
    assert policy.tree.match(blocks(shared, (14, 2))).per_engine == {"e0": 6}
    assert policy.tree.match(blocks(shared, (13, 2))).per_engine == {"e0": 4}


# -- engines leaving ----------------------------------------------------------------------------
def test_engine_removed_is_forgotten() -> None:
    policy, d = make(**QUIET)
    cap = {"e0": 100, "e1": 100}
    force(d, req(P), "e0", E2, cap=cap)
    force(d, req(P), "e1", E2, cap=cap)
    d.engine_removed("e0")
    assert policy.tree.cached_blocks("e0") == 0
    assert policy.tree.match(P).per_engine == {"e1": 4}
    assert policy.loads.load("e0") == 0.0
    assert "e0" not in policy.capacity
    decision = d.route(req(P), view(("e1",)), 1.0)
    assert (decision.engine, decision.reason) == ("e1", "preble:exploit")


def test_decide_after_a_removed_engines_window_expires() -> None:
    _, d = make(window_s=10.0)
    force(d, req(P), "e0", E2)
    d.engine_removed("e0")
    assert d.route(req(P, at=20.0), view(("e1",)), 20.0).engine == "e1"


# -- output-length prediction and TPOT ----------------------------------------------------------
def test_predicted_output_comes_from_the_tree_after_finish() -> None:
    policy, d = make(initial_tpot_s=0.1, default_output_tokens=128, rebalance=False)
    only = ("e0",)
    r1 = req(P)
    force(d, r1, "e0", only)
    assert policy.loads.decode["e0"] == pytest.approx(128 * 0.1)
    d.finished(replace(r1, output_tokens=500), "e0", 1.0, ok=True)
    force(d, req(P), "e0", only, 2.0)  # same prompt: 500 predicted
    assert policy.loads.decode["e0"] == pytest.approx((128 + 500) * 0.1)
    force(d, req(blocks((1, 2), (5, 3))), "e0", only, 3.0)  # shares a node that saw 500
    assert policy.loads.decode["e0"] == pytest.approx((128 + 500 + 500) * 0.1)
    mean = 128 + 0.05 * (500 - 128)  # unrelated prompt: the running mean
    force(d, req(blocks((9, 3))), "e0", only, 4.0)
    assert policy.loads.decode["e0"] == pytest.approx((128 + 500 + 500 + mean) * 0.1)
    # failed requests teach nothing
    r2 = req(blocks((9, 3)))
    force(d, r2, "e0", only, 5.0)
    d.finished(replace(r2, output_tokens=10_000), "e0", 6.0, ok=False)
    before = policy.loads.decode["e0"]
    force(d, req(blocks((9, 3))), "e0", only, 7.0)
    assert policy.loads.decode["e0"] - before == pytest.approx(mean * 0.1)


def test_tpot_is_learned_from_completions() -> None:
    policy, d = make(initial_tpot_s=0.1)
    r = req(P)
    force(d, r, "e0", E2)
    d.first_token(r, "e0", 1.0)
    d.finished(replace(r, output_tokens=11), "e0", 1.2, ok=True)  # 10 steps of 20 ms
    assert policy.tpot["e0"] == pytest.approx(0.1 + 0.2 * (0.02 - 0.1))


# -- random request streams ---------------------------------------------------------------------
def check_tree(policy: PreblePolicy) -> None:
    tree = policy.tree
    cached: dict[str, int] = {}
    for node in tree.nodes():
        for engine, held in node.engines.items():
            assert 1 <= held <= len(node.blocks)
            cached[engine] = cached.get(engine, 0) + held
            if node.parent is not tree.root:
                assert node.parent.engines.get(engine) == len(node.parent.blocks)
    for engine in E3:
        assert tree.cached_blocks(engine) == cached.get(engine, 0)
        capacity = policy.capacity.get(engine)
        if capacity and engine not in policy.exact:
            assert tree.cached_blocks(engine) <= capacity


# a shared head (one of two) and up to two more segments from a small alphabet
segments_st = st.tuples(
    st.tuples(st.integers(0, 1), st.integers(2, 4)),
    st.lists(st.tuples(st.integers(2, 4), st.integers(1, 2)), max_size=2),
).map(lambda p: [p[0], *p[1]])
_by_kind = {
    "route": st.tuples(
        st.just("route"), segments_st, st.integers(0, 15), st.sets(st.sampled_from(E3))
    ),
    "first": st.tuples(st.just("first"), st.integers(0, 100)),
    "finish": st.tuples(st.just("finish"), st.integers(0, 100), st.integers(1, 300), st.booleans()),
    "evicted": st.tuples(st.just("evicted"), st.sampled_from(E3), st.integers(0, 100)),
}
_kinds = ["route"] * 5 + ["first"] * 2 + ["finish"] * 2 + ["evicted"]
stream_st = st.lists(
    st.sampled_from(_kinds).flatmap(_by_kind.__getitem__), min_size=10, max_size=50
)
CAPS = {"e0": 5, "e1": 9}  # e2's capacity is never reported


@settings(max_examples=150, deadline=None)
@given(stream_st, st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 40.0]), min_size=50, max_size=50))
def test_random_streams_keep_decisions_valid_and_the_tree_consistent(
    stream: list, gaps: list[float]
) -> None:
    """Decisions stay valid and the tree consistent, replication included."""
    policy, d = make(window_s=60.0, rebalance_warmup=1)
    now = 0.0
    flight: list[tuple[RequestInfo, str]] = []
    for op, gap in zip(stream, gaps, strict=False):
        now += gap
        if op[0] == "route":
            _, segments, extra, down = op
            healthy = [e for e in E3 if e not in down] or ["e2"]
            v = ClusterView(
                tuple(
                    EngineView(id=e, healthy=e in healthy, kv_capacity_blocks=CAPS.get(e, 0))
                    for e in E3
                )
            )
            r = req(blocks(*segments), extra=extra, at=now)
            before = policy.tree.match(r.block_hashes).per_engine
            decision = d.route(r, v, now)
            assert decision.engine in healthy
            hit = min(before.get(decision.engine, 0) * BS, max(0, r.prompt_tokens - 1))
            assert decision.expected_hit_tokens == hit
            flight.append((r, decision.engine))
        elif op[0] == "first" and flight:
            r, engine = flight[op[1] % len(flight)]
            d.first_token(r, engine, now)
        elif op[0] == "finish" and flight:
            r, engine = flight.pop(op[1] % len(flight))
            d.finished(replace(r, output_tokens=op[2]), engine, now, ok=op[3])
        elif op[0] == "evicted":
            held = list(policy.tree.lru_nodes(op[1]))
            if held:
                node = held[op[2] % len(held)]
                d.cache_event(op[1], [], [node.blocks[0]])
                assert node.engines.get(op[1]) is None
        check_tree(policy)


# -- the simulator ------------------------------------------------------------------------------
def test_simulated_tool_use_hits_far_more_than_round_robin() -> None:
    workload = load_workload("gen:tool_use?n=300&rate=20")
    cluster = ClusterSpec(8, load_preset(DEFAULT_PRESET))
    hits = {}
    for name in ("round_robin", "preble"):
        summary = summarize(run_policy(name, workload, cluster))
        assert summary["completed"] == summary["requests"] == 300
        hits[name] = summary["cache_hit_rate"]
    bound = cache_hit_upper_bound(workload, lambda _r: True)
    assert hits["preble"] >= hits["round_robin"] + 0.15, hits
    assert hits["preble"] >= 0.9 * bound, (hits, bound)
