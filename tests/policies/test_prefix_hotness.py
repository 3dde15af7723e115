"""DualMap's adaptive key depth: hot prefixes are keyed deeper, cooled ones collapse, bounded.

Prompts are tuples of chained block hashes (from ``hashes_from_segments``); a request is
observed at the depth the table gives it, exactly as DualMap's ``on_routed`` does.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.blocks import hashes_from_segments
from gateway.policies.prefix_hotness import PrefixHotness

BS = 16


def blocks(*segments: tuple[int, int]) -> tuple[int, ...]:
    """Chained hashes of a prompt made of ``(segment id, blocks)`` pieces."""
    return hashes_from_segments([(seg, n * BS) for seg, n in segments], BS)


_unique = iter(range(10_000, 10_000_000))


def fresh(n: int = 2) -> tuple[int, ...]:
    """A prompt of ``n`` blocks sharing nothing with any other."""
    return blocks((next(_unique), n))


def table(instances: int = 4, **kw: object) -> PrefixHotness:
    h = PrefixHotness(**kw)  # type: ignore[arg-type]
    h.instances = instances
    return h


def route(h: PrefixHotness, prompt: tuple[int, ...]) -> int:
    """Observe ``prompt`` at its current depth (as DualMap does); returns that depth."""
    d = h.depth(prompt)
    h.observe(prompt, d)
    return d


HOT = blocks((1, 4))  # a 4-block hot prompt


def test_bad_parameters() -> None:
    for kw in ({"window": 0}, {"min_samples": 0}, {"max_expanded": 0}, {"max_depth": 0}):
        with pytest.raises(ValueError, match="positive"):
            PrefixHotness(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("instances", "hot", "cold"), [(1, 2.0, 1.0), (4, 0.5, 0.25), (8, 0.25, 0.125)]
)
def test_relative_thresholds(instances: int, hot: float, cold: float) -> None:
    h = table(instances)
    assert (h.hot, h.cold) == (hot, cold)


def test_depth_starts_at_one_and_empty_prompts_have_none() -> None:
    h = table()
    assert h.depth(HOT) == 1
    assert h.depth(HOT[:1]) == 1
    assert h.depth(()) == 0
    h.observe((), 0)  # a prompt without a full block is not counted
    h.observe(HOT, 0)
    assert len(h._window) == 0
    assert h.share(HOT[0]) == 0.0


def test_hot_key_expands_only_after_min_samples() -> None:
    h = table(4, window=100, min_samples=10)
    for _ in range(9):
        assert route(h, HOT) == 1
    assert h.share(HOT[0]) == 1.0  # far above 2/4, but only 9 samples
    assert h.expanded == 0
    assert route(h, HOT) == 1  # the 10th sample expands the key...
    assert h.expanded == 1
    assert h.depth(HOT) == 2  # ...so the next request under it keys one block deeper
    sibling = blocks((1, 1), (2, 3))  # shares HOT's first block only
    assert h.depth(sibling) == 2
    assert h.depth(blocks((3, 4))) == 1  # other prefixes are unaffected


@pytest.mark.parametrize(("hot_requests", "expanded"), [(5, 0), (6, 1)])
def test_expansion_needs_a_share_strictly_above_2_over_n(hot_requests: int, expanded: int) -> None:
    """Window of 10, n = 4: the key must hold more than 5 of the last 10 requests."""
    h = table(4, window=10, min_samples=10)
    for _ in range(10 - hot_requests):
        route(h, fresh())
    for _ in range(hot_requests):
        route(h, HOT)
    assert h.share(HOT[0]) == hot_requests / 10
    assert h.expanded == expanded
    assert h.depth(HOT) == 1 + expanded


def test_repeated_heat_deepens_up_to_the_prompt_length() -> None:
    h = table(4, window=8, min_samples=1)
    depths = [route(h, HOT) for _ in range(40)]
    assert depths[0] == 1
    assert depths == sorted(depths)  # never shallower while the prompt stays hot
    assert depths[-1] == len(HOT) == h.depth(HOT)
    assert set(depths) == {1, 2, 3, 4}  # one block at a time
    # the last block is never expanded: there is nothing deeper to key on
    assert h.expanded == len(HOT) - 1
    assert HOT[-1] not in h._expanded


def test_max_depth_caps_the_key() -> None:
    h = table(4, window=8, min_samples=1, max_depth=2)
    for _ in range(40):
        route(h, HOT)
    assert h.depth(HOT) == 2
    assert list(h._expanded) == [HOT[0]]


def test_cooling_below_1_over_n_collapses_an_ancestor() -> None:
    h = table(4, window=20, min_samples=5)
    children = [blocks((1, 1), (100 + i, 2)) for i in range(10)]  # hot first block, spread tails
    for c in children:
        route(h, c)
    assert h.depth(children[0]) == 2
    assert HOT[0] in h._expanded
    # a flood of unrelated traffic: the shared prefix cools below 1/4 of the window
    steps = 0
    while HOT[0] in h._expanded:
        route(h, fresh())
        steps += 1
        assert steps < 40
    assert h.share(HOT[0]) < h.cold
    assert h.share(HOT[0]) >= h.cold - 1 / 20  # dropped as soon as it fell under 1/n
    assert h.depth(children[0]) == 1  # requests key on the prefix itself again


def test_collapsing_the_root_collapses_a_deep_key_and_the_rest_is_swept() -> None:
    h = table(4, window=8, min_samples=1)
    for _ in range(40):
        route(h, HOT)
    assert h.depth(HOT) == 4
    assert h.expanded == 3
    steps = 0
    while h.depth(HOT) > 1:  # cooling the first block is enough to key on it again
        route(h, fresh())
        steps += 1
        # the sweep checks one expansion per request, round robin: a cold one is found
        # within (number of expansions) requests once its share fell under 1/n
        assert steps <= 8 + 3
    assert h.share(HOT[0]) < h.cold
    for _ in range(3):  # the deeper, now unreachable expansions are swept too
        route(h, fresh())
    assert h.expanded == 0


def test_expanded_key_that_stays_warm_is_kept() -> None:
    h = table(4, window=20, min_samples=5)
    for i in range(10):
        route(h, blocks((1, 1), (100 + i, 2)))
    assert HOT[0] in h._expanded
    for i in range(60):  # 1 request in 3 under the prefix: share ~0.33 > 1/4
        route(h, blocks((1, 1), (200 + i, 2)) if i % 3 == 0 else fresh())
    assert HOT[0] in h._expanded


@pytest.mark.parametrize(
    ("hot", "hot_share_reached", "expanded"),
    [
        (None, 0.6, 1),  # relative: 0.6 > 2/4
        (0.9, 0.6, 0),  # a fixed hot threshold above it: no expansion
        (0.1, 0.2, 1),  # a fixed hot threshold below 2/4: expands at 0.2
        (None, 0.2, 0),
    ],
)
def test_fixed_hot_threshold_overrides_the_relative_one(
    hot: float | None, hot_share_reached: float, expanded: int
) -> None:
    # cold fixed low: with the relative cold (1/4) a 0.2 expansion is swept at once
    h = table(4, window=10, min_samples=10, hot=hot, cold=0.05)
    hot_n = round(hot_share_reached * 10)
    for _ in range(10 - hot_n):
        route(h, fresh())
    for _ in range(hot_n):
        route(h, HOT)
    assert h.expanded == expanded


@pytest.mark.parametrize(("cold", "collapsed"), [(None, False), (0.5, True)])
def test_fixed_cold_threshold_overrides_the_relative_one(
    cold: float | None, collapsed: bool
) -> None:
    """Share 0.4 is above 1/4 (kept by default) but under a fixed 0.5 (collapsed)."""
    h = table(4, window=10, min_samples=10, cold=cold)
    for i in range(10):
        route(h, blocks((1, 1), (100 + i, 2)))
    assert HOT[0] in h._expanded
    for _ in range(6):  # the window now holds 4 requests under the prefix, 6 others
        route(h, fresh())
    assert h.share(HOT[0]) == pytest.approx(0.4)
    assert (HOT[0] not in h._expanded) == collapsed


def test_flood_of_unique_prompts_stays_bounded() -> None:
    h = table(4, window=50, min_samples=10)
    for i in range(3000):
        route(h, fresh(1 + i % 5))
    assert len(h._window) == 50
    in_window = {x for entry in h._window for x in entry}
    assert set(h._counts) == in_window  # counts only for keys in the window
    assert all(n > 0 for n in h._counts.values())
    assert h.expanded == 0  # nothing unique is ever hot


def test_expansions_are_capped() -> None:
    # hot=0 makes every observed key hot, cold=0 never cools: only the cap limits the table
    h = table(4, window=50, min_samples=1, hot=0.0, cold=0.0, max_expanded=32)
    for _ in range(500):
        route(h, fresh(3))
    assert h.expanded == 32
    assert len(h._window) == 50


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=300),
    st.integers(1, 30),
    st.integers(1, 10),
    st.integers(1, 8),
)
def test_invariants_under_any_stream(
    stream: list[tuple[int, int]], window: int, min_samples: int, instances: int
) -> None:
    """Counts match the window exactly, depths stay within the prompt and the caps."""
    h = table(instances, window=window, min_samples=min_samples, max_expanded=6, max_depth=4)
    for prefix, n in stream:
        prompt = blocks((prefix, 1), (next(_unique), n - 1)) if n > 1 else blocks((prefix, 1))
        d = route(h, prompt)
        assert 1 <= d <= min(len(prompt), 4)
        assert len(h._window) <= window
        assert h.expanded <= 6
    expected: dict[int, int] = {}
    for entry in h._window:
        for x in entry:
            expected[x] = expected.get(x, 0) + 1
    assert h._counts == expected
