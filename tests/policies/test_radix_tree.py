"""Property and unit tests of Preble's global radix tree (``gateway/policies/radix_tree.py``).

The property tests drive the tree with random operation sequences over small alphabets and
compare it with a plain reference model: the set of prefixes inserted, and per engine the set
of prefixes it holds (a prefix-closed set of tuples of block hashes). Every structural
invariant of the tree is checked after every operation.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.blocks import hashes_from_tokens
from gateway.policies.radix_tree import Node, RadixTree

ENGINES = ("a", "b", "c")
BS = 2  # block size of the chained test prompts
WINDOW = 10.0

Prefix = tuple[int, ...]


# -- helpers ---------------------------------------------------------------------------------
def chained(tokens: Sequence[int]) -> tuple[int, ...]:
    return hashes_from_tokens(list(tokens), BS)


def route(tree: RadixTree, hashes: Sequence[int], engine: str, now: float) -> list[Node]:
    """What ``PreblePolicy.on_routed`` does with the tree."""
    path = tree.insert(hashes, now)
    tree.record(path, engine, now)
    tree.add_engine(path, engine, now)
    return path


def prefix_of(node: Node) -> Prefix:
    parts: list[list[int]] = []
    n: Node | None = node
    while n is not None and n.parent is not None:
        parts.append(n.blocks)
        n = n.parent
    return tuple(h for blocks in reversed(parts) for h in blocks)


def tree_prefixes(tree: RadixTree) -> set[Prefix]:
    out: set[Prefix] = set()
    for node in tree.nodes():
        p = prefix_of(node)
        out.update(p[:k] for k in range(node.depth + 1, node.end + 1))
    return out


def tree_held(tree: RadixTree, engine: str) -> set[Prefix]:
    """The prefixes the tree attributes to ``engine`` (from the node lists, not ``match``)."""
    out: set[Prefix] = set()
    for node in tree.nodes():
        held = node.engines.get(engine, 0)
        if held:
            p = prefix_of(node)
            out.update(p[:k] for k in range(node.depth + 1, node.depth + held + 1))
    return out


def prefixes(hashes: Sequence[int]) -> set[Prefix]:
    t = tuple(hashes)
    return {t[:k] for k in range(1, len(t) + 1)}


def longest(s: set[Prefix], probe: Sequence[int]) -> int:
    t = tuple(probe)
    k = 0
    while k < len(t) and t[: k + 1] in s:
        k += 1
    return k


def check_invariants(tree: RadixTree, *, chained_input: bool = True) -> None:
    nodes = list(tree.nodes())
    assert tree.num_nodes == len(nodes)
    total = sum(len(n.blocks) for n in nodes)
    if chained_input:
        assert tree.num_blocks == total
    cached: dict[str, int] = {}
    for node in nodes:
        parent = node.parent
        assert parent is not None
        assert node.blocks, "empty node"
        assert parent.children[node.blocks[0]] is node
        assert node.depth == parent.end
        if chained_input:
            for h in node.blocks:
                assert tree.node_of(h) is node
        for engine, held in node.engines.items():
            assert 1 <= held <= len(node.blocks)
            assert tree.held(node, engine) == held
            cached[engine] = cached.get(engine, 0) + held
            if parent is not tree.root:
                assert parent.engines.get(engine) == len(parent.blocks), (
                    "an engine listed on a child must hold its parent whole"
                )
    for engine in {*ENGINES, *cached}:
        assert tree.cached_blocks(engine) == cached.get(engine, 0)
        lru = list(tree.lru_nodes(engine))
        assert len(lru) == len(set(map(id, lru)))
        assert {id(n) for n in lru} == {id(n) for n in nodes if engine in n.engines}


def check_lru_order(tree: RadixTree) -> None:
    """In every engine's LRU, a node comes after all of its descendants."""
    for engine in ENGINES:
        pos = {id(n): i for i, n in enumerate(tree.lru_nodes(engine))}
        for node in tree.lru_nodes(engine):
            anc = node.parent
            while anc is not None and anc is not tree.root:
                assert pos[id(anc)] > pos[id(node)], "an ancestor precedes its descendant"
                anc = anc.parent


def check_match(tree: RadixTree, model: Model, probe: Sequence[int]) -> None:
    m = tree.match(probe)
    assert m.blocks == longest(tree_prefixes(tree), probe)
    expected = {e: k for e in ENGINES if (k := longest(model.held[e], probe))}
    assert m.per_engine == expected
    if m.path:
        last = m.path[-1]
        assert last.depth < m.blocks <= last.end
        assert m.last_partial == (0 if m.blocks == last.end else m.blocks - last.depth)
        assert [n.depth for n in m.path] == sorted(n.depth for n in m.path)
    else:
        assert m.blocks == 0


# -- the reference model and operation sequences --------------------------------------------
@dataclass
class Model:
    inserted: set[Prefix] = field(default_factory=set)
    held: dict[str, set[Prefix]] = field(default_factory=lambda: {e: set() for e in ENGINES})
    records: list[tuple[float, str, Prefix]] = field(default_factory=list)  # for counts
    uses: list[tuple[float, Prefix]] = field(default_factory=list)  # for the window
    removed: set[str] = field(default_factory=set)  # engines passed to remove_engine
    prompts: list[Prefix] = field(default_factory=list)  # hashed prompts, in order
    tokens: list[list[int]] = field(default_factory=list)  # the same prompts, unhashed


engine_st = st.sampled_from(ENGINES)
# up to 5 chained blocks of 2 tokens, skewed so that prompts share prefixes often
tokens_st = st.integers(0, 5).flatmap(
    lambda n: st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=2 * n, max_size=2 * n + 1)
)
raw_st = st.lists(st.integers(0, 3), max_size=6)  # arbitrary, unchained "hashes"
dt_st = st.sampled_from([0, 0, 1, 3, 7, 12])


def ops_st(prompt: st.SearchStrategy[list[int]], *, removals: bool) -> st.SearchStrategy[list]:
    # a fresh prompt, or an earlier one (by index) cut after some tokens and extended
    derived = st.one_of(prompt, st.tuples(st.integers(0, 1000), st.integers(0, 12), prompt))
    # a block an engine holds (by index), or one of a fresh prompt
    pick = st.one_of(st.integers(0, 1000), st.integers(0, 1000), prompt)
    by_kind = {
        "route": st.tuples(st.just("route"), engine_st, derived, dt_st),
        "record": st.tuples(st.just("record"), engine_st, derived, dt_st),
        "evict": st.tuples(st.just("evict"), engine_st, st.integers(0, 6)),
        "expire": st.tuples(st.just("expire"), dt_st),
        "remove": st.tuples(st.just("remove"), engine_st, pick, st.integers(0, 5)),
        "drop_engine": st.tuples(st.just("drop_engine"), engine_st),
    }
    weights = {"route": 8, "record": 4, "evict": 2, "expire": 2, "remove": 6, "drop_engine": 1}
    if not removals:
        del weights["remove"]
    kinds = [k for k, w in weights.items() for _ in range(w)]
    op = st.sampled_from(kinds).flatmap(by_kind.__getitem__)
    return st.lists(op, min_size=8, max_size=40)


def apply(tree: RadixTree, model: Model, op: tuple, now: float, to_hashes) -> tuple[float, list]:
    """Apply ``op`` to the tree and the model; returns the new time and the op's probe."""
    kind = op[0]
    probe: list[int] = []
    if kind in {"route", "record"}:
        _, engine, prompt, dt = op
        now += dt
        if isinstance(prompt, tuple):
            i, cut, extra = prompt
            base = model.tokens[i % len(model.tokens)] if model.tokens else []
            prompt = [*base[:cut], *extra]
        model.tokens.append(prompt)
        hashes = to_hashes(prompt)
        probe = list(hashes)
        path = tree.insert(hashes, now)
        assert sum(len(n.blocks) for n in path) == len(hashes)
        assert [n.depth for n in path] == [
            sum(map(len, (x.blocks for x in path[:i]))) for i in range(len(path))
        ]
        tree.record(path, engine, now)
        model.records.append((now, engine, tuple(hashes)))
        model.uses.append((now, tuple(hashes)))
        model.prompts.append(tuple(hashes))
        model.inserted |= prefixes(hashes)
        if kind == "route":
            tree.add_engine(path, engine, now)
            model.held[engine] |= prefixes(hashes)
    elif kind == "remove":
        _, engine, pick, k = op
        if isinstance(pick, int):  # a block an engine holds, when one holds any
            engine = next((e for e in (engine, *ENGINES) if model.held[e]), engine)
            held = sorted(model.held[engine])
            hashes = held[pick % len(held)] if held else ()
            k = len(hashes) - 1
        else:
            hashes = to_hashes(pick)
        probe = list(hashes)
        if 0 <= k < len(hashes):
            h = hashes[k]
            before = len(model.held[engine])
            model.held[engine] = {q for q in model.held[engine] if not (len(q) > k and q[k] == h)}
            n_before = tree.num_nodes
            assert tree.remove_blocks(engine, [h]) == before - len(model.held[engine])
            assert tree.num_nodes == n_before, "eviction events must not split or drop nodes"
    elif kind == "evict":
        _, engine, n = op
        old = model.held[engine]
        freed = tree.evict_lru(engine, n)
        new = tree_held(tree, engine)
        assert new <= old, "evict_lru made up cached blocks"
        assert freed == len(old) - len(new)
        assert freed >= n or not new
        model.held[engine] = new
    elif kind == "drop_engine":
        _, engine = op
        tree.remove_engine(engine)
        model.held[engine] = set()
        model.removed.add(engine)
    elif kind == "expire":
        now += op[1]
        tree.expire(now)
    return now, probe


def check_window(tree: RadixTree, model: Model, now: float) -> None:
    present = tree_prefixes(tree)
    assert present <= model.inserted, "the tree holds a prefix nobody inserted"
    for engine in ENGINES:
        assert model.held[engine] <= present, "a cached prefix was garbage-collected"
    horizon = now - WINDOW
    for t, hashes in model.uses:
        if t >= horizon:
            assert prefixes(hashes) <= present, "a prefix used within the window was dropped"


def check_counts(tree: RadixTree, model: Model, now: float) -> None:
    """Window counts per engine and in all. An engine's hits after ``remove_engine`` are only
    bounded: the tree forgets them on the nodes the engine still cached, not elsewhere."""
    since = now - WINDOW  # ``count`` assumes ``since`` never decreases (it prunes old hits)
    for node in tree.nodes():
        p = prefix_of(node)
        used = [(t, e) for t, e, h in model.records if t >= since and h[: node.end] == p]
        for engine in ENGINES:
            if engine not in model.removed:
                assert node.count(since, engine) == sum(1 for _, e in used if e == engine)
        kept = sum(1 for _, e in used if e not in model.removed)
        assert kept <= node.count(since) <= len(used)


# -- property tests --------------------------------------------------------------------------
@settings(max_examples=250, deadline=None)
@given(ops_st(tokens_st, removals=True), st.lists(tokens_st, max_size=3))
def test_chained_tree_agrees_with_reference(ops: list, probes: list[list[int]]) -> None:
    tree = RadixTree(window_s=WINDOW, max_blocks=10_000)
    model = Model()
    now = 0.0
    for op in ops:
        now, probe = apply(tree, model, op, now, chained)
        check_invariants(tree)
        check_lru_order(tree)
        check_window(tree, model, now)
        for p in {tuple(probe), *model.prompts[-4:], *(chained(t) for t in probes)}:
            check_match(tree, model, p)
        assert all(tree.cached_blocks(e) == len(model.held[e]) for e in ENGINES)
    check_counts(tree, model, now)


@settings(max_examples=250, deadline=None)
@given(ops_st(raw_st, removals=False), st.lists(raw_st, max_size=3))
def test_unchained_tree_agrees_with_reference(ops: list, probes: list[list[int]]) -> None:
    """Arbitrary ints (repeats, no chaining): ``match`` must still be exact."""
    tree = RadixTree(window_s=WINDOW, max_blocks=10_000)
    model = Model()
    now = 0.0
    for op in ops:
        now, probe = apply(tree, model, op, now, tuple)
        check_invariants(tree, chained_input=False)
        check_window(tree, model, now)
        for p in {tuple(probe), *model.prompts[-4:], *map(tuple, probes)}:
            check_match(tree, model, p)
        assert all(tree.cached_blocks(e) == len(model.held[e]) for e in ENGINES)
    check_counts(tree, model, now)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(tokens_st, dt_st), max_size=30), st.sampled_from([1, 4, 11]))
def test_gc_keeps_exactly_the_prefixes_used_within_the_window(
    seq: list[tuple[list[int], int]], final_dt: int
) -> None:
    """With nothing cached, after ``expire(now)`` the tree is exactly the window's prefixes."""
    tree = RadixTree(window_s=WINDOW, max_blocks=10_000)
    now = 0.0
    used: list[tuple[float, tuple[int, ...]]] = []
    for tokens, dt in [*seq, ([], final_dt)]:
        now += dt
        hashes = chained(tokens)
        tree.record(tree.insert(hashes, now), "a", now)
        used.append((now, hashes))
        tree.expire(now)
        expected = set().union(*(prefixes(h) for t, h in used if t >= now - WINDOW))
        assert tree_prefixes(tree) == expected
        check_invariants(tree)
    tree.expire(now + WINDOW + 1)
    assert tree.num_nodes == 0
    assert tree.num_blocks == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["route", "record", "insert"]), engine_st, tokens_st, dt_st),
        max_size=40,
    ),
    st.integers(1, 12),
)
def test_bound_holds_after_every_insert(ops: list, max_blocks: int) -> None:
    """``num_blocks <= max_blocks`` after insert, unless the just-inserted prompt alone exceeds
    it: then the tree is exactly that prompt's path (the inserted path is never evicted)."""
    tree = RadixTree(window_s=WINDOW, max_blocks=max_blocks)
    held: dict[str, set[Prefix]] = {e: set() for e in ENGINES}
    now = 0.0
    for kind, engine, tokens, dt in ops:
        now += dt
        hashes = chained(tokens)
        path = tree.insert(hashes, now)
        assert tree.num_blocks <= max(max_blocks, len(hashes))
        if tree.num_blocks > max_blocks:
            assert tree_prefixes(tree) == prefixes(hashes)
        assert prefixes(hashes) <= tree_prefixes(tree), "the inserted path was evicted"
        assert [n for n in path if n.parent is None] == []
        # bound evictions may forget cached prefixes, never invent them
        for e in ENGINES:
            now_held = tree_held(tree, e)
            assert now_held <= held[e]
            held[e] = now_held
        if kind != "insert":
            tree.record(path, engine, now)
        if kind == "route":
            tree.add_engine(path, engine, now)
            held[engine] |= prefixes(hashes)
        check_invariants(tree)


# -- unit tests: structure and match -------------------------------------------------------
def test_constructor_rejects_non_positive_bounds() -> None:
    with pytest.raises(ValueError):
        RadixTree(max_blocks=0)
    with pytest.raises(ValueError):
        RadixTree(window_s=0)


@pytest.mark.parametrize(
    ("probe", "blocks", "last_partial", "path_lens"),
    [
        ((1, 2, 3, 4), 4, 0, [2, 2]),
        ((1, 2, 3, 4, 9), 4, 0, [2, 2]),
        ((1, 2, 3), 3, 1, [2, 2]),
        ((1, 2, 5), 3, 0, [2, 1]),
        ((1,), 1, 1, [2]),
        ((1, 9), 1, 1, [2]),
        ((7, 1, 2), 0, 0, []),
        ((), 0, 0, []),
    ],
)
def test_insert_splits_and_match_walks(
    probe: tuple[int, ...], blocks: int, last_partial: int, path_lens: list[int]
) -> None:
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], 0.0)
    tree.insert([1, 2, 5], 0.0)  # splits [1,2,3,4] into [1,2] + [3,4]
    assert tree.num_nodes == 3
    assert tree.num_blocks == 5
    m = tree.match(probe)
    assert (m.blocks, m.last_partial) == (blocks, last_partial)
    assert [len(n.blocks) for n in m.path] == path_lens
    assert tree.num_nodes == 3  # match never changes the tree


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        ((1, 9, 3, 4, 5, 6), 1),  # later blocks agree again: not chained, linear scan
        ((1, 2, 3, 9, 5, 6), 3),
        ((1, 2, 9, 9, 5, 6), 2),
        ((1, 2, 3, 4, 5, 9), 5),
        ((1, 2, 3, 4, 5, 6), 6),
        ((1, 2, 3, 4, 5, 6, 7), 6),
    ],
)
def test_match_on_unchained_input_is_exact(probe: tuple[int, ...], expected: int) -> None:
    tree = RadixTree()
    tree.add_engine(tree.insert([1, 2, 3, 4, 5, 6], 0.0), "e", 0.0)
    m = tree.match(probe)
    assert m.blocks == expected
    assert m.per_engine == {"e": expected}


def test_split_keeps_engines_hits_and_outputs() -> None:
    tree = RadixTree(window_s=100)
    path = route(tree, [1, 2, 3, 4], "e", 1.0)
    path[0].outputs.append(42)
    tree.remove_blocks("e", [4])  # e holds 3 of 4 blocks
    new = tree.insert([1, 2, 9], 2.0)
    head, tail = tree.node_of(1), tree.node_of(3)
    assert head is new[0] and tail.parent is head
    assert (head.blocks, tail.blocks) == ([1, 2], [3, 4])
    assert head.engines == {"e": 2} and tail.engines == {"e": 1}
    assert tree.cached_blocks("e") == 3
    assert head.count(0.0, "e") == tail.count(0.0, "e") == 1
    assert list(head.outputs) == list(tail.outputs) == [42]
    check_invariants(tree)


# -- unit tests: eviction events -------------------------------------------------------------
def test_remove_block_in_the_middle_shortens_without_splitting() -> None:
    tree = RadixTree()
    route(tree, [1, 2, 3, 4, 5, 6], "e", 0.0)
    route(tree, [1, 2, 3, 4, 5, 6, 7, 8], "e", 0.0)
    route(tree, [1, 2, 3, 4, 5, 6, 7, 8], "f", 0.0)
    node = tree.node_of(3)
    assert tree.num_nodes == 2
    assert tree.remove_blocks("e", [3]) == 4 + 2  # 4 of the node, 2 of its child
    assert tree.num_nodes == 2
    assert tree.held(node, "e") == 2
    assert tree.node_of(7).engines == {"f": 2}
    assert tree.cached_blocks("e") == 2
    assert tree.cached_blocks("f") == 8
    assert tree.match([1, 2, 3, 4, 5, 6, 7, 8]).per_engine == {"e": 2, "f": 8}
    # blocks past the held length, unknown blocks, unknown engines: nothing to drop
    assert tree.remove_blocks("e", [5, 7, 12345]) == 0
    assert tree.remove_blocks("zzz", [1]) == 0
    assert tree.remove_blocks("e", [1]) == 2
    assert tree.match([1, 2, 3]).per_engine == {"f": 3}
    check_invariants(tree)


def test_remove_several_blocks_in_one_event() -> None:
    tree = RadixTree()
    route(tree, [1, 2, 3, 4], "e", 0.0)
    route(tree, [1, 2, 5, 6], "e", 0.0)
    # the later block first: the earlier one then drops the rest
    assert tree.remove_blocks("e", [6, 3, 4]) == 1 + 2
    assert tree.match([1, 2, 3, 4]).per_engine == {"e": 2}
    assert tree.match([1, 2, 5, 6]).per_engine == {"e": 3}
    check_invariants(tree)


def test_lru_order_and_evict_lru() -> None:
    tree = RadixTree()
    route(tree, [1, 2, 3], "e", 1.0)
    route(tree, [1, 2, 4], "e", 2.0)  # splits: [1,2] + [3], new leaf [4]
    route(tree, [7, 8], "e", 3.0)
    order = [n.blocks for n in tree.lru_nodes("e")]
    assert order == [[3], [4], [1, 2], [7, 8]]
    tree.record([tree.node_of(1), tree.node_of(3)], "e", 4.0)  # a path touch: [3] then [1,2]
    assert [n.blocks for n in tree.lru_nodes("e")] == [[4], [7, 8], [3], [1, 2]]
    assert tree.evict_lru("e", 1) == 1  # the leaf [4]
    assert tree.evict_lru("e", 2) == 2  # [7, 8]
    assert tree.match([1, 2, 3]).per_engine == {"e": 3}
    assert tree.evict_lru("e", 100) == 3
    assert tree.cached_blocks("e") == 0
    assert tree.evict_lru("e", 1) == 0
    assert tree.evict_lru("never-seen", 1) == 0
    assert tree.num_blocks == 6  # forgetting a placement does not drop nodes
    check_invariants(tree)


def test_remove_engine_forgets_placements_and_hits() -> None:
    tree = RadixTree()
    route(tree, [1, 2, 3], "e", 1.0)
    route(tree, [1, 2, 3], "f", 1.0)
    tree.remove_engine("e")
    assert tree.cached_blocks("e") == 0
    assert list(tree.lru_nodes("e")) == []
    assert tree.match([1, 2, 3]).per_engine == {"f": 3}
    node = tree.node_of(1)
    assert node.count(0.0, "e") == 0
    assert node.count(0.0) == 1
    route(tree, [1, 2], "e", 2.0)  # the engine may come back
    assert tree.match([1, 2, 3]).per_engine == {"e": 2, "f": 3}
    check_invariants(tree)


# -- unit tests: the window, counts and garbage collection ------------------------------------
def test_counts_per_engine_and_total_in_window() -> None:
    tree = RadixTree(window_s=10)
    for t, engine in [(0.0, "a"), (1.0, "a"), (2.0, "b"), (5.0, "a")]:
        route(tree, [1, 2], engine, t)
    node = tree.node_of(1)
    assert node.count(0.0) == 4
    assert node.count(0.0, "a") == 3
    assert node.count(0.0, "b") == 1
    assert node.count(0.0, "c") == 0
    assert node.count(1.5, "a") == 1
    assert node.count(1.5) == 2
    assert node.count(6.0) == 0


def test_expire_drops_unused_uncached_nodes_and_keeps_the_rest() -> None:
    tree = RadixTree(window_s=10)
    tree.record(tree.insert([1, 2, 3], 0.0), "a", 0.0)  # used, never cached
    route(tree, [5, 6], "a", 0.0)  # cached
    tree.record(tree.insert([1, 2, 4], 5.0), "a", 5.0)  # [1,2] used again at 5
    tree.expire(9.0)
    assert tree.num_blocks == 6
    tree.expire(10.0)  # horizon 0: a use at exactly the horizon still counts
    assert tree.num_blocks == 6
    tree.expire(12.0)  # horizon 2: [3] expired; [1,2] and [4] used at 5
    assert tree_prefixes(tree) == prefixes([1, 2, 4]) | prefixes([5, 6])
    tree.expire(100.0)
    assert tree_prefixes(tree) == prefixes([5, 6])  # cached nodes survive the window
    assert tree.num_nodes == 1
    check_invariants(tree)


def test_expire_keeps_ancestors_of_recent_nodes() -> None:
    tree = RadixTree(window_s=10)
    tree.record(tree.insert([1, 2], 0.0), "a", 0.0)
    tree.record(tree.insert([1, 2, 3, 4], 8.0), "a", 8.0)
    tree.expire(15.0)
    assert tree_prefixes(tree) == prefixes([1, 2, 3, 4])
    tree.expire(18.5)
    assert tree.num_nodes == 0


@pytest.mark.parametrize("uncache", ["remove_engine", "remove_blocks", "evict_lru"])
def test_expire_drops_nodes_uncached_after_their_last_use_expired(uncache: str) -> None:
    tree = RadixTree(window_s=10)
    route(tree, [1, 2, 3], "e", 0.0)
    tree.expire(20.0)
    assert tree.num_blocks == 3  # still cached: kept
    if uncache == "remove_engine":
        tree.remove_engine("e")
    elif uncache == "remove_blocks":
        tree.remove_blocks("e", [1])
    else:
        tree.evict_lru("e", 3)
    tree.expire(40.0)
    # no engine caches it and no request used it within the window
    assert tree.num_blocks == 0


# -- unit tests: bounded memory ---------------------------------------------------------------
def test_bound_evicts_uncached_leaves_first_then_lru() -> None:
    tree = RadixTree(window_s=100, max_blocks=9)
    route(tree, [1, 2, 3], "e", 0.0)  # cached, oldest
    tree.record(tree.insert([4, 5, 6], 1.0), "e", 1.0)  # uncached
    tree.record(tree.insert([7, 8, 9], 2.0), "e", 2.0)  # uncached, newer
    tree.insert([10, 11], 3.0)  # 11 blocks > 9: the oldest uncached leaf goes
    assert tree_prefixes(tree) == prefixes([1, 2, 3]) | prefixes([7, 8, 9]) | prefixes([10, 11])
    tree.insert([12, 13, 14, 15, 16, 17, 18], 4.0)  # 15: both uncached leaves, then the cached
    assert tree_prefixes(tree) == prefixes([12, 13, 14, 15, 16, 17, 18])
    assert tree.cached_blocks("e") == 0
    check_invariants(tree)


def test_bound_shortens_paths_leaf_first() -> None:
    tree = RadixTree(window_s=100, max_blocks=5)
    tree.record(tree.insert([1, 2, 3], 0.0), "x", 0.0)
    tree.record(tree.insert([1, 2, 4], 1.0), "x", 1.0)  # [1,2] [3] [4]
    tree.record(tree.insert([9, 8], 2.0), "x", 2.0)  # 6 blocks: the leaf [3] goes, not [1,2]
    assert tree_prefixes(tree) == prefixes([1, 2, 4]) | prefixes([9, 8])
    check_invariants(tree)


def test_bound_evicts_a_parent_left_childless_in_lru_order() -> None:
    tree = RadixTree(window_s=100, max_blocks=5)
    tree.record(tree.insert([1, 2, 3], 0.0), "x", 0.0)
    tree.record(tree.insert([1, 2, 4], 1.0), "x", 1.0)  # [1,2] last used at 1
    tree.record(tree.insert([9, 8], 2.0), "x", 2.0)  # [3] goes
    tree.record(tree.insert([7, 6, 5], 3.0), "x", 3.0)  # 3 blocks must go: [4], then [1,2]
    assert tree_prefixes(tree) == prefixes([9, 8]) | prefixes([7, 6, 5])


def test_a_prompt_longer_than_the_bound_is_kept_alone() -> None:
    tree = RadixTree(window_s=100, max_blocks=4)
    route(tree, [1, 2], "e", 0.0)
    tree.insert(list(range(100, 110)), 1.0)
    assert tree.num_blocks == 10
    assert tree_prefixes(tree) == prefixes(range(100, 110))
    assert tree.cached_blocks("e") == 0
    tree.insert([1, 2], 2.0)
    assert tree_prefixes(tree) == prefixes([1, 2])
    check_invariants(tree)


def test_bound_prefers_a_leaf_left_uncached_by_a_split() -> None:
    tree = RadixTree(window_s=100, max_blocks=8)
    route(tree, [10, 11], "e", 0.0)  # W: cached, the oldest leaf
    route(tree, [1, 2, 3, 4], "e", 1.0)
    tree.remove_blocks("e", [3])  # e holds [1, 2] of the node
    tree.record(tree.insert([1, 2, 9], 2.0), "x", 2.0)  # split: tail [3, 4] is cached by nobody
    assert tree.node_of(3).engines == {}
    tree.record(tree.insert([20, 21, 22], 3.0), "x", 3.0)  # 10 blocks: 2 must go
    # uncached leaves first: [9] and the tail [3, 4]; the cached [10, 11] stays
    assert tree.match([10, 11]).per_engine == {"e": 2}
    assert tree.match([1, 2, 3, 4]).blocks == 2


SYSTEM = list(range(1_000_000, 1_000_008))  # a shared 8-block system prompt


def flood(tree: RadixTree, start: int, stop: int) -> None:
    """Unique prompts (the system prompt + 8 unique blocks) at 100/s, as the policy routes
    them: every one recorded, every third placed on an engine, ``expire`` now and then."""
    for i in range(start, stop):
        now = i * 0.01
        hashes = [*SYSTEM, *range(i * 8, i * 8 + 8)]
        path = tree.insert(hashes, now)
        assert tree.num_blocks <= tree.max_blocks
        assert tree.match(hashes).blocks == len(hashes)
        tree.record(path, f"e{i % 4}", now)
        if i % 3 == 0:
            tree.add_engine(path, f"e{i % 4}", now)
        if i % 50 == 0:
            tree.expire(now)


def test_a_flood_of_unique_prompts_stays_within_the_bound() -> None:
    tree = RadixTree(window_s=5.0, max_blocks=5000)
    flood(tree, 0, 20_000)  # 160k unique blocks through a 5000-block tree
    assert tree.num_blocks <= 5000
    assert tree.num_blocks > 4900  # the bound, not the window, is what limits it here
    assert tree.match(SYSTEM).blocks == 8  # the shared prefix outlives the tails
    check_invariants(tree)


def traced_growth(tree: RadixTree, warm: int, total: int) -> tuple[int, int]:
    gc.collect()
    tracemalloc.start()
    try:
        flood(tree, 0, warm)
        gc.collect()
        before, _ = tracemalloc.get_traced_memory()
        flood(tree, warm, total)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return before, after


def test_a_flood_of_unique_prompts_keeps_memory_flat() -> None:
    tree = RadixTree(window_s=5.0, max_blocks=5000)
    before, after = traced_growth(tree, 4000, 20_000)
    # 16k more prompts (128k blocks) through a full tree: at most 3 % more memory
    assert after <= before * 1.03, (before, after)


def test_hit_history_of_a_hot_cached_node_stays_within_the_window() -> None:
    tree = RadixTree(window_s=10.0)
    for i in range(1000):
        route(tree, [1, 2], "e", float(i))
        tree.expire(float(i))
    node = tree.node_of(1)
    assert sum(map(len, node.hits.values())) <= 11 + 1  # the requests of the last 10 s
