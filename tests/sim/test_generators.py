"""Parametric workload generators: invariants, determinism and sharing structure."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import replace
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.blocks import hashes_from_segments
from gateway.core.errors import WorkloadError
from gateway.sim import generators
from gateway.sim.generators import GENERATORS, MAX_TOKENS
from gateway.sim.workloads import WorkloadOptions, WorkloadRequest, load_workload

NAMES = [
    "tool_use",
    "long_doc_qa",
    "multi_turn",
    "zipf_hotspot",
    "no_sharing",
    "chat",
    "agent",
    "lora",
    "chat_burst",
    "conversation",
]
SESSIONS = {"multi_turn", "chat", "agent", "chat_burst", "conversation"}
OPTIONS = WorkloadOptions()

Pieces = list[tuple[int, int]]


def gen(
    name: str, options: WorkloadOptions = OPTIONS, /, **params: object
) -> list[WorkloadRequest]:
    return GENERATORS[name]({k: str(v) for k, v in params.items()}, options)


@pytest.fixture
def pieces(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Pieces]]:
    """Records the pieces of every prompt a generator hashes, in generation order."""
    seen: list[Pieces] = []

    def spy(segments: Sequence[tuple[int, int]], block_size: int, seed: int = 0) -> tuple[int, ...]:
        seen.append(list(segments))
        return hashes_from_segments(segments, block_size, seed)

    monkeypatch.setattr(generators, "hashes_from_segments", spy)
    yield seen


def test_registry() -> None:
    assert isinstance(GENERATORS, MappingProxyType)
    assert sorted(GENERATORS) == sorted(NAMES)


def test_wired_through_load_workload() -> None:
    workload = load_workload("gen:tool_use?n=50&rate=2", WorkloadOptions())
    assert len(workload) == 50
    assert workload.requests[0].id == "tool_use-0"
    assert workload.params["rate"] == "2"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_invariants(name: str, block_size: int, pieces: list[Pieces]) -> None:
    options = replace(OPTIONS, block_size=block_size)
    reqs = gen(name, options, n=150)
    assert len(reqs) == 150
    assert [r.id for r in reqs] == [f"{name}-{i}" for i in range(150)]
    arrivals = [r.arrival for r in reqs]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] == 0.0
    assert len(pieces) == 150
    lengths = sorted(sum(n for _, n in p) for p in pieces)
    assert sorted(r.prompt_tokens for r in reqs) == lengths
    for r in reqs:
        assert r.prompt_tokens >= 1
        assert r.output_tokens >= 1
        assert len(r.block_hashes) == r.prompt_tokens // block_size
        assert r.slo == options.default_class
        assert (r.session is not None) == (name in SESSIONS)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic(name: str) -> None:
    assert gen(name, n=80) == gen(name, n=80)
    assert gen(name, n=80) != gen(name, n=80, seed=1)
    assert gen(name, n=80, seed=3) == gen(name, replace(OPTIONS, seed=3), n=80)


@pytest.mark.parametrize("name", ["tool_use", "no_sharing", "zipf_hotspot"])
def test_arrival_process_keeps_content(name: str) -> None:
    poisson = gen(name, n=100)
    gamma = gen(name, n=100, arrival="gamma", cv=3, rate=1)
    assert [r.block_hashes for r in poisson] == [r.block_hashes for r in gamma]
    assert [r.arrival for r in poisson] != [r.arrival for r in gamma]


@pytest.mark.parametrize(
    ("name", "rate", "small"),
    [("tool_use", 3.0, {"tool_tokens": 20}), ("no_sharing", 10.0, {"prompt_tokens": 20})],
)
def test_rate(name: str, rate: float, small: dict[str, int]) -> None:
    reqs = gen(name, n=2000, rate=rate, **small)
    gaps = [b.arrival - a.arrival for a, b in itertools.pairwise(reqs)]
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.2)


def _segment_uses(all_pieces: list[Pieces]) -> Counter[int]:
    return Counter(seg for p in all_pieces for seg, _ in p)


@pytest.mark.parametrize(
    ("name", "items"),
    [("tool_use", 20), ("long_doc_qa", 30), ("zipf_hotspot", 50)],
)
def test_prefixed_structure(name: str, items: int, pieces: list[Pieces]) -> None:
    reqs = gen(name, n=300)
    uses = _segment_uses(pieces)
    shared = {p[0][0] for p in pieces}
    tails = [p[1][0] for p in pieces]
    assert all(len(p) == 2 for p in pieces)
    assert len(shared) <= items
    assert shared.isdisjoint(tails)
    assert all(uses[t] == 1 for t in tails)
    # The same shared item has the same length everywhere.
    assert len({p[0] for p in pieces}) == len(shared)
    # Pieces come in request order: requests with the same item share exactly
    # the blocks lying inside it; requests with different items share none.
    block = OPTIONS.block_size
    by_item: dict[int, list[WorkloadRequest]] = defaultdict(list)
    item_len = {p[0][0]: p[0][1] for p in pieces}
    for r, p in zip(reqs, pieces, strict=True):
        assert r.prompt_tokens == p[0][1] + p[1][1]
        by_item[p[0][0]].append(r)
    for item, members in by_item.items():
        k = item_len[item] // block
        for a, b in itertools.pairwise(members):
            assert a.block_hashes[:k] == b.block_hashes[:k]
            assert set(a.block_hashes[k:]).isdisjoint(b.block_hashes)
    heads = [members[0].block_hashes for members in by_item.values()]
    for i, head in enumerate(heads):
        for other in heads[i + 1 :]:
            assert set(head).isdisjoint(other)


def _reuse(reqs: list[WorkloadRequest]) -> float:
    seen: set[int] = set()
    hits = total = 0
    for r in reqs:
        for h in r.block_hashes:
            total += 1
            hits += h in seen
            seen.add(h)
    return hits / total


def test_tool_use_mostly_shared() -> None:
    assert 0.8 <= _reuse(gen("tool_use", n=1000)) <= 0.95


def test_no_sharing_shares_nothing() -> None:
    reqs = gen("no_sharing", n=300)
    assert _reuse(reqs) == 0.0
    assert statistics.fmean(r.prompt_tokens for r in reqs) == pytest.approx(1000, rel=0.15)
    assert statistics.fmean(r.output_tokens for r in reqs) == pytest.approx(128, rel=0.15)


def test_zipf_hotspot_is_skewed() -> None:
    reqs = gen("zipf_hotspot", n=1000, prefix_tokens=100)
    firsts = Counter(r.block_hashes[0] for r in reqs)
    top = firsts.most_common(1)[0][1]
    assert top / len(reqs) > 0.3  # 1 / H(50, 1.5) ≈ 0.43
    flat = Counter(
        r.block_hashes[0] for r in gen("zipf_hotspot", n=1000, prefix_tokens=100, zipf=0)
    )
    assert flat.most_common(1)[0][1] / 1000 < 0.1
    extreme = gen("zipf_hotspot", n=50, prefix_tokens=100, zipf=1000)
    assert len({r.block_hashes[0] for r in extreme}) == 1


def test_long_doc_qa_uniform_uses_every_doc() -> None:
    reqs = gen("long_doc_qa", n=600, docs=10, doc_tokens=200)
    firsts = Counter(r.block_hashes[0] for r in reqs)
    assert len(firsts) == 10
    assert max(firsts.values()) < 3 * min(firsts.values())


def test_multi_turn_sessions(pieces: list[Pieces]) -> None:
    reqs = gen("multi_turn", n=400, think=5)
    sessions: dict[str, list[WorkloadRequest]] = defaultdict(list)
    for r in reqs:
        assert r.session is not None
        sessions[r.session].append(r)
    assert 400 / 12 < len(sessions) < 400 / 2  # mean 5 turns
    for turns in sessions.values():
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.arrival >= prev.arrival
            assert nxt.prompt_tokens > prev.prompt_tokens + prev.output_tokens
            assert nxt.block_hashes[: len(prev.block_hashes)] == prev.block_hashes
    uses = _segment_uses(pieces)
    systems = {p[0][0] for p in pieces}
    assert len(systems) <= 4
    others = {seg for p in pieces for seg, _ in p[1:]}
    assert systems.isdisjoint(others)
    assert max(uses[s] for s in systems) > 1
    first_turns = [turns[0] for turns in sessions.values()]
    assert len({r.block_hashes[0] for r in first_turns}) <= 4  # shared system prompts


def test_multi_turn_answer_is_output_tokens(pieces: list[Pieces]) -> None:
    reqs = gen("multi_turn", n=60, turns=20)
    by_hashes = {r.block_hashes: r for r in reqs}
    growing = [(a, b) for a, b in itertools.pairwise(pieces) if b[: len(a)] == a]
    assert len(growing) > 20
    for a, b in growing:
        assert len(b) == len(a) + 2  # the answer to turn k, then the next message
        turn = by_hashes[hashes_from_segments(a, OPTIONS.block_size)]
        assert b[len(a)][1] == turn.output_tokens


def test_multi_turn_prompt_is_capped() -> None:
    reqs = gen("multi_turn", n=40, turns=50, user_tokens=4000, output_tokens=3000)
    assert all(r.prompt_tokens <= MAX_TOKENS for r in reqs)
    assert len({r.session for r in reqs}) > 2


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    n=st.integers(1, 12),
    seed=st.integers(0, 10**6),
    block_size=st.sampled_from([8, 16, 64]),
    arrival=st.sampled_from(["poisson", "gamma"]),
)
def test_invariants_property(name: str, n: int, seed: int, block_size: int, arrival: str) -> None:
    options = replace(OPTIONS, block_size=block_size, seed=seed)
    reqs = gen(name, options, n=n, arrival=arrival)
    assert len(reqs) == n
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)
    for r in reqs:
        assert r.prompt_tokens >= 1
        assert r.output_tokens >= 1
        assert len(r.block_hashes) == r.prompt_tokens // block_size


def test_multi_turn_single_turn_sessions() -> None:
    reqs = gen("multi_turn", n=50, turns=1)
    assert len({r.session for r in reqs}) == 50


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("tool_use", {"bogus": "1"}, "gen:tool_use: unknown parameter.*bogus"),
        ("tool_use", {"docs": "3"}, "unknown parameter.*docs"),
        ("no_sharing", {"n": "many"}, "n='many' is not an integer"),
        ("no_sharing", {"n": "0"}, "n must be >= 1"),
        ("long_doc_qa", {"docs": "2.5"}, "docs='2.5' is not an integer"),
        ("zipf_hotspot", {"zipf": "-1"}, "zipf must be a finite number >= 0"),
        ("multi_turn", {"think": "soon"}, "think='soon' is not a number"),
        ("multi_turn", {"arrival": "burst"}, "unknown arrival process 'burst'"),
        ("tool_use", {"rate": "0"}, "rate must be a positive"),
        ("tool_use", {"seed": "x"}, "seed='x' is not an integer"),
    ],
)
def test_bad_params(name: str, params: dict[str, str], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        GENERATORS[name](params, OPTIONS)


def test_unknown_generator_via_spec() -> None:
    with pytest.raises(WorkloadError, match="unknown generator 'nope'"):
        load_workload("gen:nope")
