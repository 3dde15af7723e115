"""PrefixTraffic: counts over the last ``window`` prompts, and a prompt's shared depth."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.policies.prefix_traffic import PrefixTraffic

prompts = st.lists(st.lists(st.integers(0, 6), max_size=5), max_size=40)


@settings(max_examples=200, deadline=None)
@given(prompts, st.integers(1, 8), st.integers(1, 4), st.floats(0.0, 1.0))
def test_counts_and_depth_match_a_recount_of_the_window(
    seq: list[list[int]], window: int, depth: int, share: float
) -> None:
    t = PrefixTraffic(window, max_depth=depth)
    for p in seq:
        t.observe(p)
    kept = [p[:depth] for p in seq[-window:]]
    assert len(t) == len(kept)
    for h in range(7):
        assert t.count(h) == sum(p.count(h) for p in kept)
    probe = [0, 1, 2, 3]
    expected = 0
    if kept:
        for h in probe[:depth]:
            if sum(p.count(h) for p in kept) < share * len(kept):
                break
            expected += 1
    assert t.shared_depth(probe, share) == expected


def test_a_prefix_every_request_begins_with_is_shared_and_a_history_is_not() -> None:
    t = PrefixTraffic(8)
    for i in range(8):
        t.observe((1, 2, 100 + i))
    assert t.shared_depth((1, 2, 100), 0.3) == 2
    assert t.shared_depth((1, 2, 100), 0.1) == 3  # one request of eight: 0.125
    assert t.shared_depth((9, 1, 2), 0.1) == 0  # a different first block shares nothing


def test_shrinking_the_window_forgets_the_oldest() -> None:
    t = PrefixTraffic(4)
    for h in (1, 1, 2, 2):
        t.observe((h,))
    t.resize(2)
    assert (len(t), t.count(1), t.count(2)) == (2, 0, 2)
    with pytest.raises(ValueError):
        t.resize(0)
