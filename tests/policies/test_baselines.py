"""Table-driven tests of the baseline policies on hand-built cluster views."""

from __future__ import annotations

import pytest

from gateway.core.errors import ConfigError
from gateway.core.types import ClusterView, EngineView, RequestInfo
from gateway.policies import Dispatcher, PolicyContext, create_policy, policy_names


def view(*engines: EngineView) -> ClusterView:
    return ClusterView(tuple(engines))


def ev(i: int, **kw: object) -> EngineView:
    return EngineView(id=f"e{i}", **kw)  # type: ignore[arg-type]


def req(rid: str, hashes: tuple[int, ...], prompt: int | None = None) -> RequestInfo:
    return RequestInfo(
        id=rid, block_hashes=hashes, prompt_tokens=prompt or 16 * len(hashes) + 1, arrival=0.0
    )


def route(name: str, v: ClusterView, reqs: list[RequestInfo], **opts: object) -> list[str]:
    d = Dispatcher(create_policy(name, PolicyContext(seed=1), opts or None))
    return [d.route(r, v, 0.0).engine for r in reqs]


def test_registry_lists_every_baseline() -> None:
    assert {"round_robin", "least_loaded", "power_of_two", "cache_aware", "weighted_scorer"} <= set(
        policy_names()
    )


def test_unknown_policy_and_option_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        create_policy("nope")
    with pytest.raises(ConfigError, match="unknown option"):
        create_policy("cache_aware", options={"treshold": 1})
    with pytest.raises(ConfigError, match="not a valid float"):
        create_policy("cache_aware", options={"cache_threshold": "high"})
    with pytest.raises(ConfigError, match="cache_threshold"):
        create_policy("cache_aware", options={"cache_threshold": "1.5"})


@pytest.mark.parametrize(
    ("engines", "expected"),
    [
        ([ev(0), ev(1), ev(2)], ["e0", "e1", "e2", "e0"]),
        ([ev(0), ev(1, healthy=False), ev(2)], ["e0", "e2", "e0", "e2"]),
        ([ev(0)], ["e0", "e0", "e0", "e0"]),
    ],
)
def test_round_robin_cycles_over_healthy(engines: list[EngineView], expected: list[str]) -> None:
    assert route("round_robin", view(*engines), [req(f"r{i}", ()) for i in range(4)]) == expected


@pytest.mark.parametrize(
    ("engines", "expected"),
    [
        # fewest pending prefill tokens wins
        ([ev(0, pending_prefill_tokens=500), ev(1, pending_prefill_tokens=20)], "e1"),
        # then fewest in flight
        ([ev(0, pending_prefill_tokens=5, in_flight=3), ev(1, pending_prefill_tokens=5)], "e1"),
        # unhealthy engines are never chosen
        ([ev(0, pending_prefill_tokens=900), ev(1, healthy=False)], "e0"),
    ],
)
def test_least_loaded_picks_min_pending(engines: list[EngineView], expected: str) -> None:
    assert route("least_loaded", view(*engines), [req("r", ())]) == [expected]


def test_least_loaded_rotates_among_equals() -> None:
    picks = route("least_loaded", view(ev(0), ev(1), ev(2)), [req(f"r{i}", ()) for i in range(3)])
    assert sorted(picks) == ["e0", "e1", "e2"]


def test_power_of_two_prefers_lighter_of_two() -> None:
    v = view(ev(0, pending_prefill_tokens=1000), ev(1, pending_prefill_tokens=0))
    # with two engines both are always sampled: the lighter one always wins
    assert set(route("power_of_two", v, [req(f"r{i}", ()) for i in range(20)])) == {"e1"}


def test_power_of_two_is_seeded_and_spreads() -> None:
    v = view(*(ev(i) for i in range(8)))
    reqs = [req(f"r{i}", ()) for i in range(200)]
    a, b = route("power_of_two", v, reqs), route("power_of_two", v, reqs)
    assert a == b
    assert len(set(a)) == 8


def test_cache_aware_follows_prefix_over_threshold() -> None:
    v = view(ev(0), ev(1), ev(2))
    shared = tuple(range(100, 110))
    first = req("a", (*shared, 1, 2))
    # 10 of 12 blocks shared: ratio ~0.83 > 0.5, so the second request follows the first
    second = req("b", (*shared, 3, 4))
    picks = route("cache_aware", v, [first, second])
    assert picks[0] == picks[1]


def test_cache_aware_smallest_tree_option_spreads_misses() -> None:
    v = view(ev(0), ev(1), ev(2))
    reqs = [
        req("a", tuple(range(0, 10))),
        req("b", tuple(range(20, 30))),
        req("c", tuple(range(40, 50))),
    ]
    assert sorted(route("cache_aware", v, reqs, miss="smallest_tree")) == ["e0", "e1", "e2"]


def test_cache_aware_miss_goes_to_least_loaded_not_smallest_tree() -> None:
    """SMG's current rule (sglang #14305): a miss goes to the least loaded engine, even when
    that engine already holds the largest tree."""
    d = Dispatcher(create_policy("cache_aware", PolicyContext()))
    only_e0 = view(ev(0), ev(1, healthy=False), ev(2, healthy=False))
    for i in range(3):  # e0 gets the big tree
        d.route(req(f"w{i}", tuple(range(100 * i, 100 * i + 10))), only_e0, 0.0)
    # e1 and e2 hold nothing (smallest trees) but are busier than e0
    v = view(ev(0, in_flight=1), ev(1, in_flight=5), ev(2, in_flight=6))
    assert d.route(req("miss", tuple(range(900, 910))), v, 0.0).engine == "e0"
    # a match below the 0.5 threshold is a miss too: 4 of 10 blocks shared with w0
    partial = req("p", (*tuple(range(4)), *range(950, 956)))
    v = view(ev(0, in_flight=9), ev(1, in_flight=2), ev(2, in_flight=7))
    assert d.route(partial, v, 0.0).engine == "e1"


@pytest.mark.parametrize(
    ("in_flight", "expected"),
    [
        ((200, 10, 50), "e1"),  # imbalanced: max-min > 32 and max > 1.1*min -> least loaded
        ((60, 10, 50), "e1"),  # SMG's library defaults (32 / 1.1) fire here too
        ((40, 10, 30), "e0"),  # max-min = 30 <= 32: cache affinity wins
        ((300, 280, 290), "e0"),  # 300 <= 1.1*280: cache affinity wins
    ],
)
def test_cache_aware_balance_escape(in_flight: tuple[int, int, int], expected: str) -> None:
    policy = create_policy("cache_aware", PolicyContext())
    warm = req("warm", tuple(range(10)))
    d = Dispatcher(policy)
    d.route(warm, view(ev(0), ev(1, healthy=False), ev(2, healthy=False)), 0.0)  # warms e0
    v = view(*(ev(i, in_flight=n) for i, n in enumerate(in_flight)))
    assert d.route(req("r", (*tuple(range(10)), 99)), v, 0.0).engine == expected


def test_cache_aware_reports_expected_hit() -> None:
    d = Dispatcher(create_policy("cache_aware"))
    v = view(ev(0), ev(1))
    d.route(req("a", tuple(range(8))), v, 0.0)
    decision = d.route(req("b", (*tuple(range(8)), 50)), v, 0.0)
    assert decision.expected_hit_tokens == 8 * 16


@pytest.mark.parametrize(
    ("engines", "expected"),
    [
        # queue score decides when prefixes and KV are equal
        ([ev(0, num_waiting=9), ev(1, num_waiting=0)], "e1"),
        # KV usage decides when queues are equal
        ([ev(0, kv_usage=0.9), ev(1, kv_usage=0.1)], "e1"),
    ],
)
def test_weighted_scorer_load_terms(engines: list[EngineView], expected: str) -> None:
    assert route("weighted_scorer", view(*engines), [req("r", ())]) == [expected]


def test_weighted_scorer_prefix_beats_small_load_difference() -> None:
    d = Dispatcher(create_policy("weighted_scorer", PolicyContext(seed=3)))
    cold = view(ev(0), ev(1, healthy=False))
    d.route(req("warm", tuple(range(20))), cold, 0.0)
    # e0 holds the whole prefix (prefix score ~1 -> +3), e1 has a slightly emptier KV (+0.4)
    v = view(ev(0, kv_usage=0.3), ev(1, kv_usage=0.1))
    assert d.route(req("r", (*tuple(range(20)), 7)), v, 0.0).engine == "e0"


def test_weighted_scorer_weights_are_knobs() -> None:
    d = Dispatcher(create_policy("weighted_scorer", options={"prefix_weight": 0.0}))
    cold = view(ev(0), ev(1, healthy=False))
    d.route(req("warm", tuple(range(20))), cold, 0.0)
    v = view(ev(0, kv_usage=0.3), ev(1, kv_usage=0.1))
    assert d.route(req("r", tuple(range(20))), v, 0.0).engine == "e1"


@pytest.mark.parametrize(
    "name", ["round_robin", "least_loaded", "power_of_two", "cache_aware", "weighted_scorer"]
)
def test_every_policy_only_picks_healthy(name: str) -> None:
    v = view(ev(0, healthy=False), ev(1), ev(2, healthy=False), ev(3))
    picks = route(name, v, [req(f"r{i}", tuple(range(i, i + 4))) for i in range(30)])
    assert set(picks) <= {"e1", "e3"}
