"""Property tests of the bounded approximate prefix index."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.policies.prefix_index import PrefixIndex

prompts = st.lists(st.integers(0, 30), min_size=0, max_size=12).map(tuple)
ops = st.lists(st.tuples(st.sampled_from("abcd"), prompts), max_size=40)


def reference_match(held: dict[str, set[int]], hashes: tuple[int, ...]) -> dict[str, int]:
    out = {}
    for engine, s in held.items():
        k = 0
        while k < len(hashes) and hashes[k] in s:
            k += 1
        if k:
            out[engine] = k
    return out


@settings(max_examples=200, deadline=None)
@given(ops, prompts)
def test_match_agrees_with_sets_when_unbounded(
    seq: list[tuple[str, tuple[int, ...]]], probe: tuple[int, ...]
) -> None:
    index = PrefixIndex(max_blocks=10_000)
    held: dict[str, set[int]] = {}
    for engine, hashes in seq:
        index.insert(engine, hashes)
        held.setdefault(engine, set()).update(hashes)
    assert index.match(probe) == reference_match(held, probe)
    for engine, s in held.items():
        assert index.size(engine) == len(s)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(1, 8))
def test_memory_is_bounded_per_engine(seq: list[tuple[str, tuple[int, ...]]], cap: int) -> None:
    index = PrefixIndex(max_blocks=cap)
    for engine, hashes in seq:
        index.insert(engine, hashes)
        assert index.size(engine) <= cap
    assert len(index) <= cap * 4


def test_lru_keeps_prefix_root_longest() -> None:
    index = PrefixIndex(max_blocks=4)
    index.insert("a", (1, 2, 3, 4))
    index.insert("a", (9,))  # evicts the least recent: the tail block 4
    assert index.match((1, 2, 3, 4)) == {"a": 3}


def test_remove_engine_frees_its_bit_and_blocks() -> None:
    index = PrefixIndex()
    index.insert("a", (1, 2))
    index.insert("b", (1, 2, 3))
    index.remove_engine("a")
    assert index.match((1, 2, 3)) == {"b": 3}
    index.insert("c", (1,))
    assert index.match((1, 2)) == {"b": 2, "c": 1}
    index.remove("b", [2])
    assert index.match((1, 2)) == {"b": 1, "c": 1}
