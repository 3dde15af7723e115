"""gen:chat and gen:agent: the statistics they promise, their sharing structure, determinism.

The targets are Mooncake's FAST'25 traces (docs/simulator.md): conversation mean
≈ 12k tokens in / 340 out with p99 ≈ 85k, one 512-token system block in front of
every request, ~30 % of requests continuing a conversation, 27-40 % of prompt
tokens reusable; tool&agent ≈ 8.6k in / 180 out and 59 % reusable. Tolerances
cover seeds 0-2 at the suite's 1,500 requests.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence

import pytest

from gateway.core.blocks import hashes_from_segments
from gateway.core.errors import WorkloadError
from gateway.sim import generators
from gateway.sim.generators import GENERATORS
from gateway.sim.metrics import cache_hit_upper_bound, percentile
from gateway.sim.production import tool_lengths
from gateway.sim.workloads import WorkloadOptions, WorkloadRequest, load_workload

OPTIONS = WorkloadOptions()
Pieces = list[tuple[int, int]]


def gen(
    name: str, options: WorkloadOptions = OPTIONS, /, **params: object
) -> list[WorkloadRequest]:
    return GENERATORS[name]({k: str(v) for k, v in params.items()}, options)


def _sessions(reqs: Sequence[WorkloadRequest]) -> dict[str, list[WorkloadRequest]]:
    out: dict[str, list[WorkloadRequest]] = defaultdict(list)
    for r in reqs:
        assert r.session is not None
        out[r.session].append(r)
    return out


def _stats(spec: str) -> dict[str, float]:
    wl = load_workload(spec, OPTIONS)
    prompts = [r.prompt_tokens for r in wl.requests]
    return {
        "in_mean": statistics.fmean(prompts),
        "in_p99": percentile(prompts, 99) or 0.0,
        "out_mean": statistics.fmean(r.output_tokens for r in wl.requests),
        "continued": 1 - len(_sessions(wl.requests)) / len(wl),
        "reusable": cache_hit_upper_bound(wl),
    }


@pytest.fixture(scope="module", params=[0, 1, 2])
def chat_stats(request: pytest.FixtureRequest) -> dict[str, float]:
    return _stats(f"gen:chat?n=1500&seed={request.param}")


@pytest.fixture(scope="module", params=[0, 1, 2])
def agent_stats(request: pytest.FixtureRequest) -> dict[str, float]:
    return _stats(f"gen:agent?n=1500&seed={request.param}")


def test_chat_matches_the_conversation_trace(chat_stats: dict[str, float]) -> None:
    assert chat_stats["in_mean"] == pytest.approx(12_000, rel=0.12)
    assert chat_stats["in_p99"] == pytest.approx(85_000, rel=0.25)
    assert chat_stats["out_mean"] == pytest.approx(340, rel=0.08)
    assert 0.2 <= chat_stats["continued"] <= 0.32
    assert 0.22 <= chat_stats["reusable"] <= 0.40


def test_agent_matches_the_tool_agent_trace(agent_stats: dict[str, float]) -> None:
    assert agent_stats["in_mean"] == pytest.approx(8_600, rel=0.08)
    assert agent_stats["out_mean"] == pytest.approx(180, rel=0.08)
    assert agent_stats["reusable"] == pytest.approx(0.59, abs=0.03)


def test_longer_chat_traces_reuse_more() -> None:
    """Conversations started early continue later: reuse grows towards the full trace's."""
    short = _stats("gen:chat?n=300")
    long = _stats("gen:chat?n=1500")
    assert long["continued"] > short["continued"] + 0.03
    assert long["reusable"] > short["reusable"]


@pytest.mark.parametrize("name", ["chat", "agent"])
def test_deterministic(name: str) -> None:
    assert gen(name, n=120) == gen(name, n=120)
    assert gen(name, n=120) != gen(name, n=120, seed=1)


def test_every_chat_request_starts_with_the_system_block() -> None:
    reqs = gen("chat", n=400)
    k = 512 // OPTIONS.block_size
    heads = {r.block_hashes[:k] for r in reqs}
    assert len(heads) == 1 and len(next(iter(heads))) == k
    # nothing beyond the system block is shared between sessions
    firsts = [turns[0] for turns in _sessions(reqs).values()]
    assert len({r.block_hashes[k] for r in firsts if len(r.block_hashes) > k}) == len(
        [r for r in firsts if len(r.block_hashes) > k]
    )
    other = gen("chat", n=50, system_tokens=2048)
    assert len({r.block_hashes[: 2048 // OPTIONS.block_size] for r in other}) == 1


@pytest.fixture
def pieces(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Pieces]]:
    seen: list[Pieces] = []

    def spy(segments: Sequence[tuple[int, int]], block_size: int, seed: int = 0) -> tuple[int, ...]:
        seen.append(list(segments))
        return hashes_from_segments(segments, block_size, seed)

    monkeypatch.setattr(generators, "hashes_from_segments", spy)
    yield seen


@pytest.mark.parametrize("name", ["chat", "agent"])
def test_turns_chain_prompt_answer_and_new_piece(name: str, pieces: list[Pieces]) -> None:
    reqs = gen(name, n=600, think=5)
    by_id = {r.id: p for r, p in zip(reqs, pieces, strict=True)}
    chained = 0
    for turns in _sessions(reqs).values():
        for prev, nxt in itertools.pairwise(turns):
            a, b = by_id[prev.id], by_id[nxt.id]
            assert b[: len(a)] == a  # the whole previous prompt ...
            assert len(b) == len(a) + 2
            assert b[len(a)][1] == prev.output_tokens  # ... its answer, then a new piece
            assert nxt.block_hashes[: len(prev.block_hashes)] == prev.block_hashes
            assert nxt.arrival > prev.arrival
            chained += 1
    assert chained > 600 * 0.2


def test_chat_arrivals_come_in_ticks() -> None:
    reqs = gen("chat", n=300)
    assert all(r.arrival == pytest.approx(3 * round(r.arrival / 3)) for r in reqs)
    per_tick = Counter(r.arrival for r in reqs)
    assert max(per_tick.values()) >= 5  # bursts: ~10 requests per 3-second tick
    smooth = gen("chat", n=300, tick=0)
    assert len({r.arrival for r in smooth}) == 300


@pytest.mark.parametrize(
    ("name", "small"),
    [("chat", {"user_tokens": 4000}), ("agent", {"task_tokens": 3000, "tool_tokens": 2000})],
)
def test_lengths_respect_max_len(name: str, small: dict[str, int]) -> None:
    for max_len, params in ((131_072, {}), (6000, small)):
        reqs = gen(name, n=400, max_len=max_len, **params)
        assert all(r.prompt_tokens + r.output_tokens <= max_len for r in reqs)
    long = gen("chat", n=600)
    assert max(r.prompt_tokens for r in long) > 32_768  # not clipped like the Preble generators


def test_agent_tools_are_hot_and_shared_by_most_requests() -> None:
    assert tool_lengths(2, 5000) == [2500, 7500]
    assert tool_lengths(1, 300) == [300]
    assert statistics.fmean(tool_lengths(5, 4000)) == pytest.approx(4000)
    reqs = gen("agent", n=1000)
    bs = OPTIONS.block_size
    k = 512 // bs
    assert len({r.block_hashes[:k] for r in reqs}) == 1  # the shared header
    deep = Counter(r.block_hashes[k + 2000 // bs] for r in reqs if len(r.block_hashes) > 160)
    top = deep.most_common(2)
    assert top[0][1] + top[1][1] > 0.6 * len(reqs)  # two tool prompts carry most traffic
    none = gen("agent", n=300, tool_share=0)
    firsts = [turns[0] for turns in _sessions(none).values()]
    assert len({r.block_hashes[k] for r in firsts}) == len(firsts)  # no tool: nothing shared


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("chat", {"follow": "1"}, "follow must be < 1"),
        ("agent", {"tool_share": "1.5"}, "tool_share must be <= 1"),
        ("chat", {"system_tokens": "200000"}, "system_tokens must leave room"),
        ("chat", {"tick": "-1"}, "tick must be a finite number >= 0"),
        ("agent", {"tools": "0"}, "tools must be >= 1"),
        ("chat", {"docs": "3"}, "unknown parameter.*docs"),
    ],
)
def test_bad_params(name: str, params: dict[str, str], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        GENERATORS[name](params, OPTIONS)


def test_rate_is_the_request_rate() -> None:
    """Sessions start at rate x (1 - follow); without follow-ups that is the request rate."""
    alone = load_workload("gen:chat?n=1500&tick=0&follow=0&rate=10", OPTIONS)
    assert alone.rate == pytest.approx(10, rel=0.1)
    assert len(_sessions(alone.requests)) == 1500
