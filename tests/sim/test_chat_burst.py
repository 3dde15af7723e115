"""gen:chat_burst: a shared first block on every request, Pareto-tailed prompts, conversations
that extend earlier prompts, and session starts in bursts."""

from __future__ import annotations

import random
from itertools import pairwise
from statistics import fmean, pstdev

import pytest

from gateway.core.errors import WorkloadError
from gateway.sim.production import pareto_len
from gateway.sim.workloads import WorkloadOptions, load_workload


def test_every_request_shares_its_first_block_and_some_continue_a_conversation() -> None:
    wl = load_workload("gen:chat_burst?n=600", WorkloadOptions())
    first = {r.block_hashes[0] for r in wl.requests}
    assert len(first) == 1
    by_session: dict[str, list[tuple[int, ...]]] = {}
    for r in wl.requests:
        by_session.setdefault(r.session or r.id, []).append(r.block_hashes)
    follow = sum(len(v) - 1 for v in by_session.values()) / len(wl.requests)
    assert 0.15 < follow < 0.4
    for turns in by_session.values():  # a later turn starts with the earlier prompt's blocks
        for a, b in pairwise(turns):
            assert b[: len(a) - 1] == a[: len(a) - 1]


def test_prompts_are_long_tailed() -> None:
    wl = load_workload("gen:chat_burst?n=1500", WorkloadOptions())
    prompts = sorted(r.prompt_tokens for r in wl.requests)
    p50, p99 = prompts[len(prompts) // 2], prompts[int(0.99 * len(prompts))]
    assert p99 > 8 * p50  # a lognormal of chat's default sigma (1.15) gives ~15x, Pareto more
    assert max(prompts) <= 131_072


def test_pareto_lengths_have_the_asked_mean_and_tail() -> None:
    rng = random.Random(0)
    draws = [pareto_len(rng, 1000.0, 2.5, 10**9) for _ in range(40_000)]
    assert fmean(draws) == pytest.approx(1000, rel=0.05)
    assert min(draws) >= 1000 * 1.5 / 2.5 - 1  # the scale: mean (alpha - 1) / alpha


def test_session_starts_come_in_bursts_unless_an_arrival_process_is_given() -> None:
    def gap_cv(spec: str) -> float:
        wl = load_workload(spec, WorkloadOptions())
        firsts = sorted({r.session: r.arrival for r in reversed(wl.requests)}.values())
        gaps = [b - a for a, b in pairwise(firsts)]
        return pstdev(gaps) / fmean(gaps)

    assert gap_cv("gen:chat_burst?n=1500&tick=0") > 2.0
    assert gap_cv("gen:chat_burst?n=1500&tick=0&arrival=poisson") < 1.3


def test_a_tail_index_of_one_or_less_is_refused() -> None:
    with pytest.raises(WorkloadError, match="pareto_alpha"):
        load_workload("gen:chat_burst?n=10&pareto_alpha=1", WorkloadOptions())
